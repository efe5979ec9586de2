"""Lower-layer inference: actions for the caller's observations through the shared Inference Queue
of the resident Inference Model Service (which meters the device time itself)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import numpy as np

from joynexus.api.errors import ApiError, InvalidInput, NotFound, ServiceUnavailable
from joynexus.api.gateway.admission import Admission
from joynexus.api.gateway.directory import TenantDirectory
from joynexus.api.gateway.limits import ApiLimits
from joynexus.api.gateway.service_errors import cause_of, service_errors
from joynexus.api.gateway.tensors import finite_actions, observation_arrays
from joynexus.core.serving_sets import ServingSetStore
from joynexus.protocol import schemas as s
from joynexus.protocol.wire import Tensor
from joynexus.scheduling.inference_queue import Observation
from joynexus.services.inference.cancellation import cancel_request
from joynexus.services.inference.errors import UnknownPolicyVersion

if TYPE_CHECKING:
    from joynexus.artifacts import CheckpointStore
    from joynexus.services.inference.endpoint import InferenceEndpoint


class Inference:
    """Predict and its cancellation on the deployment's Inference Model Service (or its replicas:
    the same `InferenceEndpoint`); the served-set store and the checkpoints explain a version the
    service does not hold."""

    def __init__(
        self,
        inference: InferenceEndpoint,
        checkpoints: CheckpointStore,
        serving_sets: ServingSetStore,
        directory: TenantDirectory,
        admission: Admission,
        limits: ApiLimits,
    ):
        self._inference, self._checkpoints, self._serving_sets = inference, checkpoints, serving_sets
        self._directory, self._admission, self._limits = directory, admission, limits

    def predict(self, tenant_id: str, request: s.PredictRequest, request_key: str | None = None) -> s.PredictResult:
        """Actions for the observations; a request not answered within `request.timeout_s` is
        cancelled in the service (504). With `request_key`, `cancel` can call it off."""
        arguments = self.predict_arguments(tenant_id, request)
        self._admission.check(tenant_id)
        try:
            with service_errors("observations"), self._served_again_soon(tenant_id, request.policy_version):
                # The request rides the shared Inference Queue of the resident service, which meters it.
                result = self._inference.predict(tenant_id, **arguments, request_key=request_key)
        except NotFound as error:
            raise self._unserved_version(tenant_id, request.policy_version) or error from None
        return predict_result(result)

    def cancel(self, tenant_id: str, request_key: str) -> bool:
        """Call off the tenant's predict submitted with `request_key` (its client went away): its
        queued work leaves the Inference Queue now. Also before the predict arrives there."""
        return cancel_request(self._inference, tenant_id, request_key)

    def predict_arguments(self, tenant_id: str, request: s.PredictRequest) -> dict[str, Any]:
        """The checked arguments of `InferenceModelService.predict` (blocking, or a future's)."""
        tenant = self._directory.tenant(tenant_id)
        obs = request.observations
        images, state, instructions = observation_arrays(
            tenant, obs.images, obs.state, obs.instructions, self._limits.max_samples_per_request
        )
        n = images.shape[0]
        if request.seeds is not None and len(request.seeds) != n:
            raise InvalidInput("seeds", f"expected {n} seeds (one per observation), got {len(request.seeds)}")
        if request.seeds is not None and any(not 0 <= seed < 2**63 for seed in request.seeds):
            raise InvalidInput("seeds", "each seed must be in [0, 2**63)")
        observations = [
            Observation(images=tuple(images[i]), state=state[i], instruction=instructions[i]) for i in range(n)
        ]
        return {
            "observations": observations,
            "policy_version": request.policy_version,
            "session_id": request.session_id,
            "seeds": request.seeds,
            "sample": request.sample,
            "timeout_s": request.timeout_s,
        }

    @contextmanager
    def _served_again_soon(self, tenant_id: str, version: int | None) -> Iterator[None]:
        """A version the store says is served but the service does not hold yet: the service
        restarted and the Master is loading its serving set back (a 503 to retry, not a 404)."""
        try:
            yield
        except Exception as error:
            cause = cause_of(error)
            if not isinstance(cause, UnknownPolicyVersion):
                raise
            recorded = self._serving_sets.get(tenant_id)
            if recorded is None or (version is not None and version not in recorded.versions):
                raise
            raise ServiceUnavailable(
                "the Inference Model Service restarted and is loading your served versions again",
                [
                    (
                        "policy_version",
                        f"v{version if version is not None else recorded.pinned_version} is being restored",
                    )
                ],
            ) from None

    def _unserved_version(self, tenant_id: str, version: int | None) -> ApiError | None:
        """A version that is checkpointed but not served: say how to serve it (None: not checkpointed)."""
        if version is None or version not in self._checkpoints.versions(tenant_id):
            return None
        how = (
            f"policy version {version} is checkpointed but not served: load it with POST /v1/weights/load "
            f'{{"version": {version}}} (Python: client.load_weights(version={version})), then predict again'
        )
        return ApiError(how, [("policy_version", how)]).with_status(404, "not_found")


def predict_result(result: dict[str, Any]) -> s.PredictResult:
    """The service's predict answer on the wire (non-finite actions refused: never sent to a robot)."""
    seconds = float(result.get("device_seconds", 0.0))
    values, log_probs = result.get("values"), result.get("log_probs")
    return s.PredictResult(
        policy_version=result["policy_version"],
        actions=Tensor.from_numpy(finite_actions(np.asarray(result["actions"], dtype=np.float32))),
        values=None if values is None else Tensor.from_numpy(np.asarray(values, dtype=np.float32)),
        log_probs=None if log_probs is None else Tensor.from_numpy(np.asarray(log_probs, dtype=np.float32)),
        batch_samples=result["batch_samples"],
        device_seconds=seconds,
    )
