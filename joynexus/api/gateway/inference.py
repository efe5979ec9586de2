"""Lower-layer inference: actions for the caller's observations through the shared Inference Queue
of the resident Inference Model Service (which meters the device time itself)."""

from __future__ import annotations

from typing import Any

import numpy as np

from joynexus.api.errors import InvalidInput
from joynexus.api.gateway.base import GatewayBase
from joynexus.api.gateway.service_errors import service_errors
from joynexus.api.gateway.tensors import observation_arrays
from joynexus.protocol import schemas as s
from joynexus.protocol.wire import Tensor
from joynexus.scheduling.inference_queue import Observation


class InferenceOperations(GatewayBase):
    def predict(self, tenant_id: str, request: s.PredictRequest) -> s.PredictResult:
        arguments = self.predict_arguments(tenant_id, request)
        self.check_admission(tenant_id)
        with service_errors("observations"):
            # The request rides the shared Inference Queue of the resident service, which meters it.
            result = self.cluster.inference.predict(tenant_id, **arguments)
        return predict_result(result)

    def predict_arguments(self, tenant_id: str, request: s.PredictRequest) -> dict[str, Any]:
        """The checked arguments of `InferenceModelService.predict` (blocking, or a future's)."""
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
        return {
            "observations": observations,
            "policy_version": request.policy_version,
            "session_id": request.session_id,
            "seeds": request.seeds,
            "sample": request.sample,
            "timeout_s": request.timeout_s,
        }


def predict_result(result: dict[str, Any]) -> s.PredictResult:
    """The service's predict answer on the wire."""
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
