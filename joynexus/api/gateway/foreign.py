"""Foreign weights (a tenant's own, or the admin's for any tenant): weights trained elsewhere
installed as the tenant's next version.

The uploaded bytes go from here to the Training Model Service (which checks each tensor against the
tenant's slot, issues the next version and checkpoints it), never through the Master Service: the
Master admits the install before (healthy tenant, no running workload, source and config checked)
and has the tenant's producer replica serve and register the new version after (`master/
foreign_weights.py`). The services' and the Master's errors come back as API errors."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from joynexus.api.errors import ApiError, NotFound
from joynexus.api.gateway.admission import Admission
from joynexus.api.gateway.directory import TenantDirectory
from joynexus.api.gateway.service_errors import cause_of, invalid_from, service_errors
from joynexus.master.errors import TenantUnavailable
from joynexus.protocol import schemas as s

if TYPE_CHECKING:
    from joynexus.master.service import MasterService
    from joynexus.services.training.service import TrainingModelService


class ForeignWeights:
    def __init__(
        self, master: MasterService, training: TrainingModelService, directory: TenantDirectory, admission: Admission
    ):
        self._master, self._training, self._directory, self._admission = master, training, directory, admission

    def install(self, tenant_id: str, request: s.InstallWeightsRequest, installed_by: str) -> s.InstalledWeights:
        self._directory.tenant(tenant_id)
        self._admission.check(tenant_id, storage=True)  # a new checkpoint
        with _master_errors(tenant_id):
            self._master.admit_weights_install(tenant_id, source=request.source, config=request.config)
        with service_errors("weights"):  # a tensor that does not fit: "weights.<name>: reason"
            manifest = self._training.install_weights(tenant_id, request.weights)
        with _master_errors(tenant_id):
            installed = self._master.publish_installed_weights(
                tenant_id, int(manifest["policy_version"]), source=request.source,
                sha256=hashlib.sha256(request.weights).hexdigest(), installed_by=installed_by,
            )  # fmt: skip
        return s.InstalledWeights.model_validate(installed)


@contextmanager
def _master_errors(tenant_id: str) -> Iterator[None]:
    try:
        yield
    except Exception as error:
        cause = cause_of(error)
        if isinstance(cause, TenantUnavailable):
            raise ApiError(str(cause), [("tenant", cause.reason)]).with_status(409, "tenant_unhealthy") from None
        if isinstance(cause, KeyError):
            raise NotFound("tenant", tenant_id, "tenant_id") from None
        if isinstance(cause, ValueError | TypeError):
            raise invalid_from(cause, "weights") from None
        raise
