"""Lower-layer inference: actions for the caller's observations through the shared Inference Queue
of the resident Inference Model Service (which meters the device time itself)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from joynexus.api.errors import InvalidInput, ServiceUnavailable
from joynexus.api.gateway.base import GatewayBase
from joynexus.api.gateway.service_errors import cause_of, service_errors
from joynexus.api.gateway.tensors import observation_arrays
from joynexus.core.serving_sets import ServingSetStore
from joynexus.protocol import schemas as s
from joynexus.protocol.wire import Tensor
from joynexus.scheduling.inference_queue import Observation
from joynexus.services.inference.errors import UnknownPolicyVersion


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
        with service_errors("observations"), self._served_again_soon(tenant_id, request.policy_version):
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
            recorded = ServingSetStore(self.cluster.store).get(tenant_id)
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
