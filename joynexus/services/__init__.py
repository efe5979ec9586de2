"""The execution plane: the Ray-resident services (Training / Inference Model Service, Environment
Service) and what they share (tenant residency). The Master's threads live in `joynexus.master.loops`."""
