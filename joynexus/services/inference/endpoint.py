"""What callers of the deployment's Inference Model Service rely on: the interface one service
(`InferenceModelService`) and a set of its replicas (`InferenceReplicaSet`) both implement, so the
API, the Master and rollout loops use either through the same calls (locally or on a Ray actor,
where methods are called by name)."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Protocol

from joynexus.scheduling.inference_queue import Observation


class InferenceEndpoint(Protocol):
    """Requests, weights, tenants and status of an Inference Model Service (or replicas of it)."""

    def submit(
        self,
        tenant_id: str,
        observations: list[Observation],
        *,
        policy_version: int | None = None,
        session_id: str | None = None,
        seeds: list[int] | None = None,
        sample: bool = False,
        operation: str = "predict",
        request_key: str | None = None,
    ) -> Future: ...

    def cancel(self, tenant_id: str, request_key: str) -> bool: ...

    def predict(
        self,
        tenant_id: str,
        observations: list[Observation] | list[dict[str, Any]],
        *,
        policy_version: int | None = None,
        session_id: str | None = None,
        seeds: list[int] | None = None,
        sample: bool = False,
        timeout_s: float | None = 60.0,
        operation: str = "predict",
        request_key: str | None = None,
    ) -> dict[str, Any]: ...

    def load_weights(self, payload: bytes) -> dict[str, Any]: ...

    def versions(self, tenant_id: str) -> list[int]: ...

    def latest_version(self, tenant_id: str) -> int | None: ...

    def tenants(self) -> list[str]: ...

    def remove_tenant(self, tenant_id: str) -> int: ...

    def flush_usage(self) -> bool: ...

    def stats(self) -> dict[str, Any]: ...

    def heartbeat(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


class PredictBySubmit:
    """`predict` written once for both implementations (a mixin): `submit`, then wait for the result."""

    def predict(
        self: InferenceEndpoint,
        tenant_id: str,
        observations: list[Observation] | list[dict[str, Any]],
        *,
        policy_version: int | None = None,
        session_id: str | None = None,
        seeds: list[int] | None = None,
        sample: bool = False,
        timeout_s: float | None = 60.0,
        operation: str = "predict",
        request_key: str | None = None,
    ) -> dict[str, Any]:
        """Actions (and values where the module has a value head) for a tenant's observations;
        `sample=True` also returns the log-probabilities of the sampled actions (see `submit`).
        The result's `device_seconds` is this request's share of its shared batch's time.
        A request not answered within `timeout_s` is cancelled (its queued work leaves the queue)
        and TimeoutError raised; `request_key` lets the caller `cancel` it meanwhile."""
        observations = [o if isinstance(o, Observation) else Observation(**o) for o in observations]
        future = self.submit(
            tenant_id,
            observations,
            policy_version=policy_version,
            session_id=session_id,
            seeds=seeds,
            sample=sample,
            operation=operation,
            request_key=request_key,
        )
        try:
            return future.result(timeout=timeout_s)
        finally:  # timed out (or cancelled, or interrupted): nobody waits for it, so nothing runs it
            if not future.done():
                future.cancel()
