"""The deployment's health as the API reports it: the Master's Health Manager's report per role."""

from __future__ import annotations

from typing import TYPE_CHECKING

from joynexus.actors import handle_of
from joynexus.protocol import schemas as s

if TYPE_CHECKING:
    from joynexus.master.service import MasterService


def deployment_health(master: MasterService, timeout_s: float = 5.0) -> s.Health:
    """The report per role; `down` when the Master does not answer within `timeout_s` (its handle's
    `probe` bounds the wait, locally and on Ray)."""
    try:
        roles = handle_of(master).probe("health", timeout_s)
    except Exception as error:
        detail = f"the Master Service does not answer: {type(error).__name__}: {error}"[:300]
        return s.Health(
            status="down", version=s.API_VERSION, roles={"master": s.RoleHealth(healthy=False, detail=detail)}
        )
    status = "ok" if all(entry["healthy"] for entry in roles.values()) else "degraded"
    return s.Health(
        status=status, version=s.API_VERSION, roles={name: s.RoleHealth(**entry) for name, entry in roles.items()}
    )
