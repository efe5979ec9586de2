"""The data loops (paper Fig. 6/7, Appendix A.4-A.5): the SFT producer (`sft.py`), the RL rollout
producer and the environment sessions evaluation also runs in (`rollout.py`), and the advantage stage
(`advantages.py`), over the common producer loop (`base.py`). They talk to the Environment, Inference
and Training services and the Training Queue by handle and import no model stack at module level.
Today the Master still runs them as threads of its process (issue 40 moves them into their own role)."""
