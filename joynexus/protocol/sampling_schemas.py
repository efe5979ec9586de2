"""Request and response models of the lower layer's sampling calls and call futures (issue 28):
`sample`, `compute_logprobs`, and the future a `POST /v1/futures/{call}` answers with. Shared by
the server and `joynexus.client`, light like `schemas`."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from joynexus.protocol.schemas import ObservationBatch, SampleBatch
from joynexus.protocol.wire import Tensor

MAX_SAMPLES_PER_OBSERVATION = 64
FUTURE_ID_PATTERN = r"^fut-[0-9]{1,20}-[0-9a-f]{12}$"
FutureCall = Literal["forward_backward", "optim_step", "predict", "sample", "compute_logprobs"]


class SampleRequest(BaseModel):
    """`n` action chunks per observation from the tenant's current TRAINING policy (the slot, not a
    served version), at `temperature` (the policy's std scaled by it); `seed`: the same seed, the
    same draws (None: the server picks one and returns it)."""

    model_config = ConfigDict(extra="forbid")

    observations: ObservationBatch
    n: int = Field(default=1, ge=1, le=MAX_SAMPLES_PER_OBSERVATION)
    temperature: float = Field(default=1.0, gt=0, le=10)
    seed: int | None = Field(default=None, ge=0, lt=2**63)


class SampleResult(BaseModel):
    model_config = ConfigDict(extra="ignore")

    actions: Tensor  # (N, n, action_chunk, action_dim) float32, in the units forward_backward takes
    log_probs: Tensor | None = None  # (N, n): None for a head without a density (flow matching)
    version: int  # the training version sampled from
    seed: int
    device_seconds: float


class ComputeLogprobsRequest(SampleBatch):
    """Observations and the actions to score (train_batch's fields); padded steps are left out."""


class ComputeLogprobsResult(BaseModel):
    model_config = ConfigDict(extra="ignore")

    log_probs: Tensor  # (N,) float32: log pi(action_i | obs_i) under the current training policy
    version: int
    device_seconds: float


class FutureInfo(BaseModel):
    """A submitted call: collect it with GET /v1/futures/{future_id} (200 with the call's own answer
    when done, its own error when it failed, 202 with this while it waits or runs)."""

    model_config = ConfigDict(extra="ignore")

    future_id: str
    kind: FutureCall
    state: Literal["pending", "running", "done", "failed"]
    submitted_at: float
