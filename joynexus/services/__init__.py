"""The execution plane: the Ray-resident services (Training / Inference Model Service, Environment
Service), what they share (tenant residency), and the data loops (`producers/`: SFT and rollout
producers, advantage stage; the Master runs them as threads of its process). The Master's own control
loop (the actor loop) is in `joynexus.master.loops`."""
