"""Core types shared by every layer: the control-plane store and the compiled tenant."""
