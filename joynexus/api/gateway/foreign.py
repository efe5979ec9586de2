"""Foreign weights (a tenant's own, or the admin's for any tenant): weights trained elsewhere
installed as the tenant's next version; the Master Service's errors as API errors."""

from __future__ import annotations

from typing import TYPE_CHECKING

from joynexus.api.errors import ApiError, NotFound
from joynexus.api.gateway.admission import Admission
from joynexus.api.gateway.directory import TenantDirectory
from joynexus.api.gateway.service_errors import invalid_from
from joynexus.master.errors import TenantUnavailable
from joynexus.protocol import schemas as s

if TYPE_CHECKING:
    from joynexus.master.service import MasterService


class ForeignWeights:
    def __init__(self, master: MasterService, directory: TenantDirectory, admission: Admission):
        self._master, self._directory, self._admission = master, directory, admission

    def install(self, tenant_id: str, request: s.InstallWeightsRequest, installed_by: str) -> s.InstalledWeights:
        self._directory.tenant(tenant_id)
        self._admission.check(tenant_id, storage=True)  # a new checkpoint
        try:
            installed = self._master.install_weights(
                tenant_id, request.weights, source=request.source, installed_by=installed_by, config=request.config
            )
        except TenantUnavailable as error:
            raise ApiError(str(error), [("tenant", error.reason)]).with_status(409, "tenant_unhealthy") from None
        except KeyError:
            raise NotFound("tenant", tenant_id, "tenant_id") from None
        except (ValueError, TypeError) as error:
            raise invalid_from(error, "weights") from None
        return s.InstalledWeights.model_validate(installed)
