"""The names of the lower layer's off-policy losses, apart from their math (`policy_losses`, torch):
the API checks a request's `loss` against them without importing torch."""

from __future__ import annotations

__all__ = ["OFF_POLICY_LOSSES"]

OFF_POLICY_LOSSES = ("importance_sampling", "ppo_clip")
