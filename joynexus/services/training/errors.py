"""Errors the Training Model Service raises to callers, in a module of their own: the API and other
clients catch them without importing the service (torch, the backbone), and Ray unpickles them
on a client from here."""

from __future__ import annotations

__all__ = ["TenantSlotError", "UnknownTenant"]


class TenantSlotError(RuntimeError):
    pass


class UnknownTenant(TenantSlotError, KeyError):
    def __init__(self, tenant_id: str):
        super().__init__(f"tenant {tenant_id!r} has no slot in this Training Model Service")
