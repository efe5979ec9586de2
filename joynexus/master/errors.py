"""The Master Service's errors its clients catch, in a module of their own: the API imports them
without importing the Master (its workloads, the services, torch), and Ray unpickles them on a
client from here."""

from __future__ import annotations

from typing import Any

__all__ = ["AdmissionRefused", "TenantUnavailable", "UnknownWorkload"]


class TenantUnavailable(RuntimeError):
    """The tenant exists but its backend slot could not be built; the reason says why."""

    def __init__(self, tenant_id: str, reason: str):
        self.tenant_id, self.reason = tenant_id, reason
        super().__init__(f"tenant {tenant_id!r} is unhealthy: {reason}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.tenant_id, self.reason))


class UnknownWorkload(KeyError):
    def __init__(self, workload_id: str):
        self.workload_id = workload_id
        super().__init__(f"no workload {workload_id!r}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.workload_id,))


class AdmissionRefused(RuntimeError):
    """Raised by an admission hook to refuse new work (e.g. a spend cap was reached)."""
