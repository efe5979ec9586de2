"""Environment Service (paper 4.4): simulator sessions, in one process or a worker pool."""
