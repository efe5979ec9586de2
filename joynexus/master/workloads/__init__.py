"""Workloads: admission, the training-workload lifecycle, evaluations, and the roles that run them."""
