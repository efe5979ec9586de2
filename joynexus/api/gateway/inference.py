"""Lower-layer inference: actions for the caller's observations through the shared Inference Queue
of the resident Inference Model Service (which meters the device time itself)."""

from __future__ import annotations

import numpy as np

from joynexus.api.errors import ApiError, InvalidInput, NotFound
from joynexus.api.gateway.base import GatewayBase
from joynexus.api.gateway.service_errors import service_errors
from joynexus.api.gateway.tensors import observation_arrays
from joynexus.protocol import schemas as s
from joynexus.protocol.wire import Tensor
from joynexus.scheduling.inference_queue import Observation


class InferenceOperations(GatewayBase):
    def predict(self, tenant_id: str, request: s.PredictRequest) -> s.PredictResult:
        tenant = self.tenant(tenant_id)
        obs = request.observations
        images, state, instructions = observation_arrays(
            tenant, obs.images, obs.state, obs.instructions, self.limits.max_samples_per_request
        )
        n = images.shape[0]
        if request.seeds is not None and len(request.seeds) != n:
            raise InvalidInput("seeds", f"expected {n} seeds (one per observation), got {len(request.seeds)}")
        if request.seeds is not None and any(not 0 <= seed < 2**63 for seed in request.seeds):
            raise InvalidInput("seeds", "each seed must be in [0, 2**63)")
        observations = [
            Observation(images=tuple(images[i]), state=state[i], instruction=instructions[i]) for i in range(n)
        ]
        self.check_admission(tenant_id)
        try:
            with service_errors("observations"):
                # The request rides the shared Inference Queue of the resident service, which meters it.
                result = self.cluster.inference.predict(
                    tenant_id,
                    observations,
                    policy_version=request.policy_version,
                    session_id=request.session_id,
                    seeds=request.seeds,
                    sample=request.sample,
                    timeout_s=request.timeout_s,
                )
        except NotFound as error:
            raise self._unserved_version(tenant_id, request.policy_version) or error from None
        seconds = float(result.get("device_seconds", 0.0))
        values, log_probs = result.get("values"), result.get("log_probs")
        return s.PredictResult(
            policy_version=result["policy_version"],
            actions=Tensor.from_numpy(np.asarray(result["actions"], dtype=np.float32)),
            values=None if values is None else Tensor.from_numpy(np.asarray(values, dtype=np.float32)),
            log_probs=None if log_probs is None else Tensor.from_numpy(np.asarray(log_probs, dtype=np.float32)),
            batch_samples=result["batch_samples"],
            device_seconds=seconds,
        )

    def _unserved_version(self, tenant_id: str, version: int | None) -> ApiError | None:
        """A version that is checkpointed but not served: say how to serve it (None: not checkpointed)."""
        if version is None or version not in self.cluster.checkpoints.versions(tenant_id):
            return None
        how = (
            f"policy version {version} is checkpointed but not served: load it with POST /v1/weights/load "
            f'{{"version": {version}}} (Python: client.load_weights(version={version})), then predict again'
        )
        return ApiError(how, [("policy_version", how)]).with_status(404, "not_found")
