"""Lower-layer sampling (`sample`, `compute_logprobs` on the caller's training slot) and futures of
lower-layer calls (`services.call_futures`): a call is checked here exactly as its blocking form
is, then queued behind the tenant's earlier calls; collecting it answers what the blocking call
would have answered, its errors included.

In Ray mode the queue is the deployment's one `CallFutures` actor, which every API replica shares
(created by the first replica that needs it); in process it is a local object of this gateway."""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
from pydantic import BaseModel

from joynexus.actors import handle_of, running_actor, service_handle
from joynexus.api.errors import ApiError, Conflict, InvalidInput, QuotaExceeded
from joynexus.api.gateway.base import GatewayBase
from joynexus.api.gateway.inference import InferenceOperations, predict_result
from joynexus.api.gateway.service_errors import service_errors
from joynexus.api.gateway.tensors import observation_arrays, sample_columns
from joynexus.api.gateway.training import TrainingPrimitives, timed_call
from joynexus.core.metering import TRAINING
from joynexus.data.normalization import SIMULATOR_BOUNDS_SOURCE, Normalizer
from joynexus.protocol import sampling_schemas as ss
from joynexus.protocol import schemas as s
from joynexus.protocol.wire import Tensor
from joynexus.services.call_futures import (
    CALL_FUTURES_ACTOR_NAME,
    CallFutures,
    FutureRefused,
    UnknownFuture,
    call_futures_actor,
)
from joynexus.services.sample_slices import SampleVersionChanged, sample_in_slices

R = TypeVar("R")
# The field a service error of each call is reported under (as the blocking routes do).
_ERROR_FIELD = {
    "forward_backward": "batch",
    "optim_step": "tenant",
    "predict": "observations",
    "sample": "sample",
    "compute_logprobs": "compute_logprobs",
}
RESULT_MODELS: dict[str, type[BaseModel]] = {
    "forward_backward": s.ForwardBackwardResult,
    "optim_step": s.OptimStepResult,
    "predict": s.PredictResult,
    "sample": ss.SampleResult,
    "compute_logprobs": ss.ComputeLogprobsResult,
}


class FutureOperations(GatewayBase):
    """Sampling and call futures; the checks of the blocking calls are theirs (`TrainingPrimitives`,
    `InferenceOperations`), so a future is refused for exactly what the blocking call refuses."""

    # -- sampling, blocking --------------------------------------------------------------------------
    def sample(
        self, tenant_id: str, request: ss.SampleRequest, *, turn: Callable[[Callable[[], R]], R] | None = None
    ) -> ss.SampleResult:
        """The call in slices (`sample_in_slices`), each inside `turn` (the caller's place in line
        for the Training Model Service: the API's training gate) when given."""
        arguments = self.sample_arguments(tenant_id, request)
        self.check_admission(tenant_id)
        training = self.cluster.training

        def one_slice(sliced: dict[str, Any]) -> dict[str, Any]:
            result, seconds = timed_call("sample", training, tenant_id, **sliced)
            return {**result, "seconds": result.get("seconds", seconds)}  # the service's own time, not its queue

        with service_errors("sample"):
            try:
                slicing = {"slice_chunks": self.limits.sample_slice_chunks, **({"turn": turn} if turn else {})}
                result = sample_in_slices(one_slice, arguments, **slicing)
            except SampleVersionChanged as error:
                raise Conflict(str(error), [("sample", str(error))]) from None
        seconds = result["seconds"]
        self.meter.record(tenant_id, TRAINING, "sample", device_seconds=seconds)
        return sample_result(self, tenant_id, {**result, "seconds": seconds})

    def compute_logprobs(self, tenant_id: str, request: ss.ComputeLogprobsRequest) -> ss.ComputeLogprobsResult:
        columns = sample_columns(self.tenant(tenant_id), request, self.limits.max_samples_per_request)
        self.check_admission(tenant_id)
        with service_errors("compute_logprobs"):
            result, seconds = timed_call("compute_logprobs", self.cluster.training, tenant_id, columns)
        seconds = result.get("seconds", seconds)
        self.meter.record(tenant_id, TRAINING, "compute_logprobs", device_seconds=seconds)
        return logprobs_result({**result, "seconds": seconds})

    def sample_arguments(self, tenant_id: str, request: ss.SampleRequest) -> dict[str, Any]:
        """`TrainingModelService.sample`'s checked arguments: the observations as columns (state
        normalized as forward_backward normalizes it), n, temperature and a seed (drawn if none)."""
        tenant = self.tenant(tenant_id)
        obs = request.observations
        images, state, instructions = observation_arrays(
            tenant, obs.images, obs.state, obs.instructions, self.limits.max_samples_per_request
        )
        n = images.shape[0]
        bound = self.limits.max_sampled_chunks_per_request
        if n * request.n > bound:
            raise InvalidInput(
                "n",
                f"{n} observations x n={request.n} are {n * request.n:,} chunks to draw, above the {bound:,} one "
                "sampling call may draw (max_sampled_chunks_per_request): split the call",
            )
        normalizer = _normalizer(self, tenant_id)
        if normalizer is not None:
            state = normalizer.normalize_state(state)
        columns = {
            "images": images,
            "state": state,
            "task": instructions,
            "tenant_id": [tenant_id] * n,
            "schema_signature": [tenant.schema_signature] * n,
        }
        seed = request.seed if request.seed is not None else secrets.randbelow(2**63)
        return {"batch": columns, "n": request.n, "temperature": request.temperature, "seed": seed}

    # -- futures -------------------------------------------------------------------------------------
    def call_futures(self) -> CallFutures:
        """The deployment's call queue (created on first use; module docstring)."""
        with self._lock:
            futures = getattr(self, "_call_futures", None)
            if futures is None:
                training, inference = handle_of(self.cluster.training), handle_of(self.cluster.inference)
                if training.is_remote:
                    settings = self.cluster.settings
                    if self.cluster.creates_services:
                        actor = call_futures_actor(
                            training.target,
                            inference.target,
                            database_url=settings.resolved_database_url(),
                            namespace=settings.ray_namespace,
                        )
                    else:  # a client of a deployment: the services' creator made it (`joynexus up`)
                        actor = running_actor(CALL_FUTURES_ACTOR_NAME, settings.ray_namespace, "the futures call queue")
                    futures = service_handle(CallFutures, actor)
                else:
                    futures = CallFutures(self.cluster.training, self.cluster.inference, meter=self.meter)
                    self._local_call_futures = futures
                self._call_futures = futures
            return futures

    def forget_call_futures(self) -> None:
        """Drop the call queue's handle: a new Ray session (the follower reconnected) voids it; the
        next use looks the actor up again."""
        with self._lock:
            self._call_futures = None

    def submit_call(self, tenant_id: str, kind: str, request: BaseModel | None) -> ss.FutureInfo:
        """Check `request` as the blocking `kind` call would, then queue it: the future's info."""
        if kind == "forward_backward":
            assert isinstance(request, s.ForwardBackwardRequest)
            columns = TrainingPrimitives.forward_backward_columns(self, tenant_id, request)  # type: ignore[arg-type]
            loss_config = None if request.loss_config is None else request.loss_config.model_dump(exclude_none=True)
            args: dict[str, Any] = {"batch": columns, "loss": request.loss, "loss_config": loss_config}
        elif kind == "optim_step":
            assert request is None or isinstance(request, s.OptimStepRequest)
            self.tenant(tenant_id)
            adamw = None if request is None else request.model_dump(exclude_none=True)
            args = {"adamw": adamw or None}
        elif kind == "predict":
            assert isinstance(request, s.PredictRequest)
            args = InferenceOperations.predict_arguments(self, tenant_id, request)  # type: ignore[arg-type]
        elif kind == "sample":
            assert isinstance(request, ss.SampleRequest)
            args = self.sample_arguments(tenant_id, request)
        else:
            assert isinstance(request, ss.ComputeLogprobsRequest)
            args = {"batch": sample_columns(self.tenant(tenant_id), request, self.limits.max_samples_per_request)}
        if kind != "optim_step":
            self.check_admission(tenant_id)
        try:
            info = self.call_futures().submit(tenant_id, kind, args)
        except FutureRefused as error:
            raise QuotaExceeded(str(error), [("futures", str(error))]) from None
        return ss.FutureInfo(**info)

    def collect_call(self, tenant_id: str, future_id: str, wait_s: float) -> tuple[ss.FutureInfo, BaseModel | None]:
        """(the future's info, the call's answer when it is done); a failed call raises its own
        error, as the blocking call would have."""
        try:
            info = self.call_futures().collect(tenant_id, future_id, wait_s)
        except UnknownFuture:
            reason = f"no future {future_id!r} in your tenant (never submitted, or its result expired)"
            raise ApiError(reason, [("future_id", reason)]).with_status(404, "not_found") from None
        kind = info["kind"]
        if info["state"] == "failed":
            with service_errors(_ERROR_FIELD[kind]):
                raise info["error"]
        public = ss.FutureInfo(**{k: info[k] for k in ("future_id", "kind", "state", "submitted_at")})
        if info["state"] != "done":
            return public, None
        raw = info["result"]
        if kind == "forward_backward":
            return public, forward_backward_result(raw)
        if kind == "optim_step":
            return public, optim_step_result(raw)
        if kind == "predict":
            return public, predict_result(raw)
        if kind == "sample":
            return public, sample_result(self, tenant_id, raw)
        return public, logprobs_result(raw)

    def stop(self) -> None:
        # A gateway used again after a stop (a server's lifespan ended, another began over the same
        # gateway) makes a new queue on first use instead of submitting to a closed one.
        with self._lock:
            local = getattr(self, "_local_call_futures", None)
            self._local_call_futures = self._call_futures = None
        if local is not None:
            local.close()
        super().stop()


def _normalizer(gateway: GatewayBase, tenant_id: str) -> Normalizer | None:
    """The tenant's normalizer when forward_backward applies it (a dataset's; not simulator bounds)."""
    normalizer = Normalizer.from_dict(gateway.tenant(tenant_id, healthy=False).backend_config.normalization)
    if normalizer is None or normalizer.source == SIMULATOR_BOUNDS_SOURCE:
        return None
    return normalizer


def forward_backward_result(raw: dict[str, Any]) -> s.ForwardBackwardResult:
    return s.ForwardBackwardResult(
        loss=raw["loss"],
        samples=raw["samples"],
        accumulated_microbatches=raw["accumulated_microbatches"],
        accumulated_samples=raw["accumulated_samples"],
        version=raw["version"],
        device_seconds=raw.get("seconds", 0.0),
    )


def optim_step_result(raw: dict[str, Any]) -> s.OptimStepResult:
    fields = ("loss", "grad_norm", "microbatches", "samples", "optimizer_steps", "version")
    used = {k: raw.get(k) for k in ("lr", "betas", "weight_decay", "grad_clip")}  # the step's hyperparameters
    return s.OptimStepResult(**{k: raw[k] for k in fields}, **used, device_seconds=raw.get("seconds", 0.0))


def sample_result(gateway: GatewayBase, tenant_id: str, raw: dict[str, Any]) -> ss.SampleResult:
    """Sampled actions in the units forward_backward takes (a dataset normalizer undone)."""
    actions = np.asarray(raw["actions"], dtype=np.float32)
    normalizer = _normalizer(gateway, tenant_id)
    if normalizer is not None:
        actions = np.asarray(normalizer.unnormalize_action(actions), dtype=np.float32)
    log_probs = raw.get("log_probs")
    return ss.SampleResult(
        actions=Tensor.from_numpy(actions),
        log_probs=None if log_probs is None else Tensor.from_numpy(np.asarray(log_probs, dtype=np.float32)),
        version=raw["version"],
        seed=raw["seed"],
        device_seconds=raw.get("seconds", 0.0),
    )


def logprobs_result(raw: dict[str, Any]) -> ss.ComputeLogprobsResult:
    return ss.ComputeLogprobsResult(
        log_probs=Tensor.from_numpy(np.asarray(raw["log_probs"], dtype=np.float32)),
        version=raw["version"],
        device_seconds=raw.get("seconds", 0.0),
    )


__all__ = ["RESULT_MODELS", "FutureOperations"]
