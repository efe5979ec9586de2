"""Inference Model Service (paper 4.3): serving states, the shared forward, replicas."""
