"""The producer service (paper Fig. 6/7, Appendix A.4-A.5; issue 40): the data loops run here, in
producer replicas (`service.py`), not in the Master: the SFT producer (`sft.py`), the RL rollout
producer and the environment sessions evaluation also runs in (`rollout.py`, `evaluation.py`), the
advantage stage (`advantages.py`), the spec compiler (`spec_compiler.py`) and every weight move. They
talk to the Environment, Inference and Training services and the Training Queue by handle; the
Master places and follows their work through the front (`front.py`)."""
