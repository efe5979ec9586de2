"""The Master's control loop: the actor loop (leases, staleness check, train by handle, complete / fail /
drop). The data loops it supervises live in `joynexus.services.producers`."""
