"""Waiting through a service that restarts in place: which errors mean "wait and try again" (a
service gone or restarting, or full) rather than a failure of the work, and the bounded wait."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from joynexus.actors import role_unavailable
from joynexus.services.environment.service import SessionLimitExceeded
from joynexus.services.training.errors import UnknownTenant

if TYPE_CHECKING:
    from joynexus.master.tenant_creator import TenantCreator

log = logging.getLogger(__name__)
R = TypeVar("R")


class ServiceWaits:
    """`on_unavailable(reason)` is told whenever a role finds a service down or restarting (the
    Master Service sets it to the Health Manager's `check_now`, which checks at once)."""

    def __init__(self, creator: TenantCreator, on_unavailable: Callable[[str], None] | None = None):
        self._creator = creator
        self.on_unavailable = on_unavailable

    def unavailable(self, reason: str) -> None:
        """Tell the listener (if any) that a service was found away; late-bound, so roles started
        before the listener was set tell it too."""
        if self.on_unavailable is not None:
            self.on_unavailable(reason)

    def restarting(self, error: BaseException, tenant_id: str) -> bool:
        """A service is gone or restarting in place (its call failed), or it is back without the
        tenant's slot yet (the Health Manager restores slots on its next round)."""
        if role_unavailable(error):
            return True
        return isinstance(error, UnknownTenant) and self._tenant_exists(tenant_id)

    def must_wait(self, error: BaseException, tenant_id: str) -> bool:
        """Wait and try again (not a failure of the work): a service restarting, or full."""
        # (A producer's own waits, for a version served again, happen on its replica.)
        return isinstance(error, SessionLimitExceeded) or self.restarting(error, tenant_id)

    def through(self, call: Callable[[], R], tenant_id: str, what: str, wait_s: float = 120.0) -> R:
        """`call()`, waited through a restart in place of the service it calls (bounded)."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                return call()
            except Exception as error:
                if not self.must_wait(error, tenant_id) or time.monotonic() > deadline:
                    raise
                log.warning("%s of tenant %s waits for a restarting service: %s", what, tenant_id, error)
                self.unavailable(f"{what}: {type(error).__name__}")
                time.sleep(1.0)

    def _tenant_exists(self, tenant_id: str) -> bool:
        try:
            self._creator.get(tenant_id)
            return True
        except KeyError:
            return False
