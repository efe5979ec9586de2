"""Lower-layer training primitives on the caller's slot: train_batch, forward_backward + optim_step,
metered in device-seconds like the services meter their own calls."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from joynexus.actors import SerializedService, handle_of
from joynexus.algorithms.loss_names import OFF_POLICY_LOSSES
from joynexus.api.errors import InvalidInput
from joynexus.api.gateway.admission import Admission
from joynexus.api.gateway.directory import TenantDirectory
from joynexus.api.gateway.limits import ApiLimits
from joynexus.api.gateway.service_errors import service_errors
from joynexus.api.gateway.tensors import float_array, sample_columns
from joynexus.core.metering import TRAINING, UsageMeter
from joynexus.protocol import schemas as s

if TYPE_CHECKING:  # the type only: the API calls the service by name and never imports torch
    from joynexus.services.training.service import TrainingModelService


def timed_call(method: str, service: Any, *args: Any, **kwargs: Any) -> tuple[Any, float]:
    """Call the service's method named `method` (e.g. `TrainingModelService.train_batch`: by name, so
    the API never imports the service module and torch) on `service` (its handle): (result,
    seconds). A local serialized service reports the time the method itself ran (not its wait for
    the lock); a Ray actor's includes its queue."""
    handle = handle_of(service)
    if isinstance(handle.target, SerializedService):
        return handle.target.call_timed(method, *args, **kwargs)
    started = time.perf_counter()
    result = getattr(handle, method)(*args, **kwargs)
    return result, time.perf_counter() - started


class TrainingCalls:
    """Steps on the caller's training slot, checked against its schema and metered."""

    def __init__(
        self,
        training: TrainingModelService,
        directory: TenantDirectory,
        admission: Admission,
        meter: UsageMeter,
        limits: ApiLimits,
    ):
        self._training, self._directory, self._admission = training, directory, admission
        self._meter, self._limits = meter, limits

    def train_batch(self, tenant_id: str, batch: s.SampleBatch) -> s.TrainStepResult:
        tenant = self._directory.tenant(tenant_id)
        columns = sample_columns(tenant, batch, self._limits.max_samples_per_request)
        self._admission.check(tenant_id)
        with service_errors("batch"):
            result, seconds = timed_call("train_batch", self._training, tenant_id, columns)
        samples = len(columns["task"])
        self._meter.record(tenant_id, TRAINING, "train_batch", device_seconds=seconds, samples=samples)
        return s.TrainStepResult(
            loss=result["loss"],
            version=result["version"],
            optimizer_steps=result["optimizer_steps"],
            samples=samples,
            device_seconds=seconds,
        )

    def forward_backward_columns(self, tenant_id: str, request: s.ForwardBackwardRequest) -> dict[str, Any]:
        """The checked columns of a forward_backward call (blocking, or a future's)."""
        tenant = self._directory.tenant(tenant_id)
        columns = sample_columns(tenant, request, self._limits.max_samples_per_request)
        samples = len(columns["task"])
        if request.loss != "default":
            if request.advantages is None:
                raise InvalidInput("advantages", f"required when loss is {request.loss!r}: one float per sample")
            columns["advantages"] = float_array(request.advantages, "advantages", (samples,))
        elif request.advantages is not None:
            raise InvalidInput("advantages", "not used by loss 'default'")
        off_policy = request.loss in OFF_POLICY_LOSSES
        if off_policy and request.sampling_logprobs is None:
            raise InvalidInput("sampling_logprobs", f"required when loss is {request.loss!r}: one float per sample")
        if request.sampling_logprobs is not None:
            if not off_policy:
                used_by = " or ".join(map(repr, OFF_POLICY_LOSSES))
                raise InvalidInput("sampling_logprobs", f"only used with loss {used_by}")
            columns["sampling_logprobs"] = float_array(request.sampling_logprobs, "sampling_logprobs", (samples,))
        return columns

    def forward_backward(self, tenant_id: str, request: s.ForwardBackwardRequest) -> s.ForwardBackwardResult:
        columns = self.forward_backward_columns(tenant_id, request)
        samples = len(columns["task"])
        loss_config = None if request.loss_config is None else request.loss_config.model_dump(exclude_none=True)
        self._admission.check(tenant_id)
        with service_errors("batch"):
            result, seconds = timed_call(
                "forward_backward", self._training, tenant_id, columns, request.loss,
                loss_config,
            )  # fmt: skip
        seconds = result.get("seconds", seconds)
        self._meter.record(tenant_id, TRAINING, "forward_backward", device_seconds=seconds, samples=samples)
        return s.ForwardBackwardResult(
            loss=result["loss"],
            samples=samples,
            accumulated_microbatches=result["accumulated_microbatches"],
            accumulated_samples=result["accumulated_samples"],
            version=result["version"],
            device_seconds=seconds,
        )

    def optim_step(self, tenant_id: str, request: s.OptimStepRequest | None = None) -> s.OptimStepResult:
        self._directory.tenant(tenant_id)
        adamw = None if request is None else request.model_dump(exclude_none=True)
        with service_errors("tenant"):
            result, seconds = timed_call("optim_step", self._training, tenant_id, adamw)
        seconds = result.get("seconds", seconds)
        self._meter.record(tenant_id, TRAINING, "optim_step", device_seconds=seconds)
        return s.OptimStepResult(
            loss=result["loss"],
            grad_norm=result["grad_norm"],
            microbatches=result["microbatches"],
            samples=result["samples"],
            optimizer_steps=result["optimizer_steps"],
            version=result["version"],
            device_seconds=seconds,
            lr=result.get("lr"),
            betas=result.get("betas"),
            weight_decay=result.get("weight_decay"),
            grad_clip=result.get("grad_clip"),
        )
