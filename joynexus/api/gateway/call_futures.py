"""Futures of lower-layer calls (`services.call_futures`): a call is checked here exactly as its
blocking form is, then queued behind the tenant's earlier calls; collecting it answers what the
blocking call would have answered, its errors included.

In Ray mode the queue is the deployment's one `CallFutures` actor, which every API replica shares
(created by the first replica that needs it); in process it is a local object of this gateway."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from joynexus.actors import handle_of, running_actor, service_handle
from joynexus.api.errors import ApiError, QuotaExceeded
from joynexus.api.gateway.admission import Admission
from joynexus.api.gateway.directory import TenantDirectory
from joynexus.api.gateway.inference import Inference, predict_result
from joynexus.api.gateway.sampling import Sampling, logprobs_result
from joynexus.api.gateway.service_errors import service_errors
from joynexus.api.gateway.training import TrainingCalls
from joynexus.core.metering import UsageMeter
from joynexus.protocol import sampling_schemas as ss
from joynexus.protocol import schemas as s
from joynexus.services.call_futures import (
    CALL_FUTURES_ACTOR_NAME,
    CallFutures,
    FutureRefused,
    UnknownFuture,
    call_futures_actor,
)

if TYPE_CHECKING:
    from joynexus.connect import Cluster

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


class CallQueue:
    """Futures of the lower-layer calls; the checks of the blocking calls are theirs (`TrainingCalls`,
    `Sampling`, `Inference`), so a future is refused for exactly what the blocking call refuses."""

    def __init__(
        self,
        cluster: Cluster,
        training_calls: TrainingCalls,
        sampling: Sampling,
        inference: Inference,
        directory: TenantDirectory,
        admission: Admission,
        meter: UsageMeter,
    ):
        self._cluster = cluster  # where the queue is made: the handles, the settings, whether we create actors
        self._training_calls, self._sampling, self._inference = training_calls, sampling, inference
        self._directory, self._admission, self._meter = directory, admission, meter
        self._lock = threading.Lock()
        self._futures: CallFutures | None = None
        self._local: CallFutures | None = None  # the in-process queue this gateway made (closed by `close`)

    def call_futures(self) -> CallFutures:
        """The deployment's call queue (created on first use; module docstring)."""
        with self._lock:
            if self._futures is None:
                where = self._cluster
                training, inference = handle_of(where.training), handle_of(where.inference)
                if training.is_remote:
                    settings = where.settings
                    if where.creates_services:
                        actor = call_futures_actor(
                            training.target,
                            inference.target,
                            database_url=settings.resolved_database_url(),
                            namespace=settings.ray_namespace,
                        )
                    else:  # a client of a deployment: the services' creator made it (`joynexus up`)
                        actor = running_actor(CALL_FUTURES_ACTOR_NAME, settings.ray_namespace, "the futures call queue")
                    self._futures = service_handle(CallFutures, actor)
                else:
                    self._futures = self._local = CallFutures(where.training, where.inference, meter=self._meter)
            return self._futures

    def forget(self) -> None:
        """Drop the call queue's handle: a new Ray session (the follower reconnected) voids it; the
        next use looks the actor up again."""
        with self._lock:
            self._futures = None

    def submit(self, tenant_id: str, kind: str, request: BaseModel | None) -> ss.FutureInfo:
        """Check `request` as the blocking `kind` call would, then queue it: the future's info."""
        if kind == "forward_backward":
            assert isinstance(request, s.ForwardBackwardRequest)
            columns = self._training_calls.forward_backward_columns(tenant_id, request)
            loss_config = None if request.loss_config is None else request.loss_config.model_dump(exclude_none=True)
            args: dict[str, Any] = {"batch": columns, "loss": request.loss, "loss_config": loss_config}
        elif kind == "optim_step":
            assert request is None or isinstance(request, s.OptimStepRequest)
            self._directory.tenant(tenant_id)
            adamw = None if request is None else request.model_dump(exclude_none=True)
            args = {"adamw": adamw or None}
        elif kind == "predict":
            assert isinstance(request, s.PredictRequest)
            args = self._inference.predict_arguments(tenant_id, request)
        elif kind == "sample":
            assert isinstance(request, ss.SampleRequest)
            args = self._sampling.sample_arguments(tenant_id, request)
        else:
            assert isinstance(request, ss.ComputeLogprobsRequest)
            args = {"batch": self._sampling.logprobs_columns(tenant_id, request)}
        if kind != "optim_step":
            self._admission.check(tenant_id)
        try:
            info = self.call_futures().submit(tenant_id, kind, args)
        except FutureRefused as error:
            raise QuotaExceeded(str(error), [("futures", str(error))]) from None
        return ss.FutureInfo(**info)

    def collect(self, tenant_id: str, future_id: str, wait_s: float) -> tuple[ss.FutureInfo, BaseModel | None]:
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
            return public, self._sampling.sample_result(tenant_id, raw)
        return public, logprobs_result(raw)

    def close(self) -> None:
        """Close the in-process queue this gateway made. A gateway used again after a stop (a
        server's lifespan ended, another began over the same gateway) makes a new queue on first
        use instead of submitting to a closed one."""
        with self._lock:
            local, self._local, self._futures = self._local, None, None
        if local is not None:
            local.close()


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


__all__ = ["RESULT_MODELS", "CallQueue"]
