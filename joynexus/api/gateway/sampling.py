"""Lower-layer sampling on the caller's training slot: `sample` (actions drawn from the policy, with
their log-probabilities) and `compute_logprobs` (of given actions), checked against the tenant's
schema and metered; sampled actions come back in the units forward_backward takes."""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from joynexus.api.errors import Conflict, InvalidInput
from joynexus.api.gateway.admission import Admission
from joynexus.api.gateway.directory import TenantDirectory
from joynexus.api.gateway.limits import ApiLimits
from joynexus.api.gateway.service_errors import service_errors
from joynexus.api.gateway.tensors import observation_arrays, sample_columns
from joynexus.api.gateway.training import timed_call
from joynexus.core.metering import TRAINING, UsageMeter
from joynexus.data.normalization import SIMULATOR_BOUNDS_SOURCE, Normalizer
from joynexus.protocol import sampling_schemas as ss
from joynexus.protocol.wire import Tensor
from joynexus.services.sample_slices import SampleVersionChanged, sample_in_slices

if TYPE_CHECKING:  # the type only: the API calls the service by name and never imports torch
    from joynexus.services.training.service import TrainingModelService

R = TypeVar("R")


class Sampling:
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

    def sample(
        self, tenant_id: str, request: ss.SampleRequest, *, turn: Callable[[Callable[[], R]], R] | None = None
    ) -> ss.SampleResult:
        """The call in slices (`sample_in_slices`), each inside `turn` (the caller's place in line
        for the Training Model Service: the API's training gate) when given."""
        arguments = self.sample_arguments(tenant_id, request)
        self._admission.check(tenant_id)
        training = self._training

        def one_slice(sliced: dict[str, Any]) -> dict[str, Any]:
            result, seconds = timed_call("sample", training, tenant_id, **sliced)
            return {**result, "seconds": result.get("seconds", seconds)}  # the service's own time, not its queue

        with service_errors("sample"):
            try:
                slicing = {"slice_chunks": self._limits.sample_slice_chunks, **({"turn": turn} if turn else {})}
                result = sample_in_slices(one_slice, arguments, **slicing)
            except SampleVersionChanged as error:
                raise Conflict(str(error), [("sample", str(error))]) from None
        seconds = result["seconds"]
        self._meter.record(tenant_id, TRAINING, "sample", device_seconds=seconds)
        return self.sample_result(tenant_id, {**result, "seconds": seconds})

    def compute_logprobs(self, tenant_id: str, request: ss.ComputeLogprobsRequest) -> ss.ComputeLogprobsResult:
        columns = self.logprobs_columns(tenant_id, request)
        self._admission.check(tenant_id)
        with service_errors("compute_logprobs"):
            result, seconds = timed_call("compute_logprobs", self._training, tenant_id, columns)
        seconds = result.get("seconds", seconds)
        self._meter.record(tenant_id, TRAINING, "compute_logprobs", device_seconds=seconds)
        return logprobs_result({**result, "seconds": seconds})

    def logprobs_columns(self, tenant_id: str, request: ss.ComputeLogprobsRequest) -> dict[str, Any]:
        """The checked columns of a compute_logprobs call (blocking, or a future's)."""
        return sample_columns(self._directory.tenant(tenant_id), request, self._limits.max_samples_per_request)

    def sample_arguments(self, tenant_id: str, request: ss.SampleRequest) -> dict[str, Any]:
        """`TrainingModelService.sample`'s checked arguments: the observations as columns (state
        normalized as forward_backward normalizes it), n, temperature and a seed (drawn if none)."""
        tenant = self._directory.tenant(tenant_id)
        obs = request.observations
        images, state, instructions = observation_arrays(
            tenant, obs.images, obs.state, obs.instructions, self._limits.max_samples_per_request
        )
        n = images.shape[0]
        bound = self._limits.max_sampled_chunks_per_request
        if n * request.n > bound:
            raise InvalidInput(
                "n",
                f"{n} observations x n={request.n} are {n * request.n:,} chunks to draw, above the {bound:,} one "
                "sampling call may draw (max_sampled_chunks_per_request): split the call",
            )
        normalizer = self._normalizer(tenant_id)
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

    def sample_result(self, tenant_id: str, raw: dict[str, Any]) -> ss.SampleResult:
        """Sampled actions in the units forward_backward takes (a dataset normalizer undone)."""
        actions = np.asarray(raw["actions"], dtype=np.float32)
        normalizer = self._normalizer(tenant_id)
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

    def _normalizer(self, tenant_id: str) -> Normalizer | None:
        """The tenant's normalizer when forward_backward applies it (a dataset's; not simulator bounds)."""
        normalizer = Normalizer.from_dict(self._directory.tenant(tenant_id, healthy=False).backend_config.normalization)
        if normalizer is None or normalizer.source == SIMULATOR_BOUNDS_SOURCE:
            return None
        return normalizer


def logprobs_result(raw: dict[str, Any]) -> ss.ComputeLogprobsResult:
    return ss.ComputeLogprobsResult(
        log_probs=Tensor.from_numpy(np.asarray(raw["log_probs"], dtype=np.float32)),
        version=raw["version"],
        device_seconds=raw.get("seconds", 0.0),
    )
