"""Admission of new work from the caller's tenant: its spend cap and, for calls that write a
checkpoint, its storage quota (the usage ledger's numbers)."""

from __future__ import annotations

from joynexus.api.errors import QuotaExceeded
from joynexus.master.usage import SpendCapReached, StorageQuotaReached, UsageLedger


class Admission:
    def __init__(self, ledger: UsageLedger):
        self._ledger = ledger

    def check(self, tenant_id: str, *, storage: bool = False) -> None:
        """Refuse new work over the spend cap; with `storage` (a call that writes a checkpoint) also
        over the storage quota (listing checkpoints is not worth it on every predict or step)."""
        try:
            self._ledger.check_spend(tenant_id, storage=storage)
        except StorageQuotaReached as error:
            raise QuotaExceeded(str(error), [("quota.max_storage_bytes", str(error))]) from None
        except SpendCapReached as error:
            raise QuotaExceeded(str(error), [("quota.max_device_seconds", str(error))]) from None
