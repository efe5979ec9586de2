"""Futures and sampling in the clients (issue 28): `forward_backward_async`, `optim_step_async`,
`predict_async`, `sample_async`, `compute_logprobs_async` return a future at once (the server queues
the call behind the tenant's earlier ones); `.result(timeout)` collects the answer, the blocking
call's model, or raises the blocking call's error. `sample` / `compute_logprobs` block.

    fb = client.forward_backward_async(images, state, action)   # returns at once
    step = client.optim_step_async()                           # runs after fb, in order
    next_batch = load()                                        # overlaps with the two calls
    print(fb.result(timeout=60).loss, step.result(timeout=60).version)

`SyncFutureCalls` / `AsyncFutureCalls` are mixed into `JoyNexusClient` / `AsyncJoyNexusClient`.
"""

from __future__ import annotations

import asyncio
import functools
import time
from typing import Any, Generic, Literal, TypeVar

from pydantic import BaseModel, TypeAdapter, ValidationError

from joynexus.client.calls import Calls, _checked, _samples, _tensor
from joynexus.client.errors import InvalidResponse, JoyNexusError, _body
from joynexus.client.transport import Call
from joynexus.protocol import sampling_schemas as ss
from joynexus.protocol import schemas as s

R = TypeVar("R", bound=BaseModel)
Loss = Literal["default", "advantage_weighted", "policy_gradient"]
_POLL_S = 30.0  # one GET waits at most this long on the server


class FutureTimeout(JoyNexusError):
    """`result(timeout)` ran out before the call finished (the call itself goes on)."""

    def __init__(self, future_id: str, timeout: float):
        super().__init__(None, _body("timeout", f"future {future_id} did not finish within {timeout:g} s"))
        self.future_id = future_id


class FutureCallBuilders:
    """What each future / sampling call sends (checked before sending, like `Calls`)."""

    @staticmethod
    def submit(blocking: Call, kind: str) -> Call:
        return Call("POST", f"/v1/futures/{kind}", ss.FutureInfo, blocking.body)

    @staticmethod
    def collect(future_id: str, wait_s: float) -> Call:
        return Call("GET", f"/v1/futures/{future_id}", None, params={"wait_s": round(wait_s, 3)})

    @staticmethod
    def sample(images: Any, state: Any, instructions: Any, n: int, temperature: float, seed: int | None) -> Call:
        observations = s.ObservationBatch(
            images=_tensor(images, "images", "image"), state=_tensor(state, "state"), instructions=instructions
        )
        body = ss.SampleRequest(observations=observations, n=n, temperature=temperature, seed=seed)
        return Call("POST", "/v1/sample", ss.SampleResult, body)

    @staticmethod
    def compute_logprobs(images: Any, state: Any, action: Any, action_is_pad: Any, instructions: Any) -> Call:
        body = ss.ComputeLogprobsRequest(**_samples(images, state, action, action_is_pad, instructions))
        return Call("POST", "/v1/compute_logprobs", ss.ComputeLogprobsResult, body)


for _name in ("sample", "compute_logprobs"):
    setattr(FutureCallBuilders, _name, _checked(getattr(FutureCallBuilders, _name)))


@functools.cache
def _adapter(model: type[BaseModel]) -> TypeAdapter:
    return TypeAdapter(model)


def _answer(future_id: str, model: type[R], data: Any) -> R | None:
    """The call's answer from a collect's body; None while it is not done (a 202's FutureInfo)."""
    if isinstance(data, dict) and data.get("future_id") == future_id and "state" in data:
        return None
    try:
        return _adapter(model).validate_python(data)
    except ValidationError as error:
        raise InvalidResponse(f"the answer of future {future_id}", str(error.errors()[0]["msg"])) from None


class CallFuture(Generic[R]):
    """A submitted call of the sync client: `.result(timeout)`, `.done()`."""

    def __init__(self, client: Any, info: ss.FutureInfo, model: type[R]):
        self.client, self.info, self.model = client, info, model
        self.future_id = info.future_id
        self._result: R | None = None

    def __repr__(self) -> str:
        return f"CallFuture({self.info.kind}, {self.future_id!r})"

    def done(self) -> bool:
        """Whether the call has finished (collects its answer if so; a failure raises)."""
        return self._collect(0.0) is not None

    def result(self, timeout: float | None = None) -> R:
        """The call's answer, waiting up to `timeout` seconds (None: as long as it takes)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = _POLL_S if deadline is None else max(0.0, deadline - time.monotonic())
            answer = self._collect(min(left, _POLL_S))
            if answer is not None:
                return answer
            if deadline is not None and time.monotonic() >= deadline:
                raise FutureTimeout(self.future_id, float(timeout or 0.0))

    def _collect(self, wait_s: float) -> R | None:
        if self._result is None:
            data = self.client._run(FutureCallBuilders.collect(self.future_id, wait_s))
            self._result = _answer(self.future_id, self.model, data)
        return self._result


class AsyncCallFuture(Generic[R]):
    """A submitted call of the asyncio client: `await .result(timeout)`, `await .done()`."""

    def __init__(self, client: Any, info: ss.FutureInfo, model: type[R]):
        self.client, self.info, self.model = client, info, model
        self.future_id = info.future_id
        self._result: R | None = None

    def __repr__(self) -> str:
        return f"AsyncCallFuture({self.info.kind}, {self.future_id!r})"

    async def done(self) -> bool:
        return await self._collect(0.0) is not None

    async def result(self, timeout: float | None = None) -> R:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = _POLL_S if deadline is None else max(0.0, deadline - time.monotonic())
            answer = await self._collect(min(left, _POLL_S))
            if answer is not None:
                return answer
            if deadline is not None and time.monotonic() >= deadline:
                raise FutureTimeout(self.future_id, float(timeout or 0.0))
            await asyncio.sleep(0)

    async def _collect(self, wait_s: float) -> R | None:
        if self._result is None:
            data = await self.client._run(FutureCallBuilders.collect(self.future_id, wait_s))
            self._result = _answer(self.future_id, self.model, data)
        return self._result


def _fb_call(images: Any, state: Any, action: Any, action_is_pad: Any, instructions: Any, loss: str, adv: Any) -> Call:
    return FutureCallBuilders.submit(
        Calls.forward_backward(images, state, action, action_is_pad, instructions, loss, adv), "forward_backward"
    )


def _predict_call(images: Any, state: Any, instructions: Any, policy_version: Any, seeds: Any, sample: bool) -> Call:
    blocking = Calls.predict(images, state, instructions, policy_version, seeds, None, sample, 60.0)
    return FutureCallBuilders.submit(blocking, "predict")


class SyncFutureCalls:
    """The futures and sampling calls of `JoyNexusClient` (module docstring)."""

    _run: Any

    def _future(self, call: Call, model: type[R]) -> CallFuture[R]:
        return CallFuture(self, self._run(call), model)

    def forward_backward_async(
        self,
        images: Any,
        state: Any,
        action: Any,
        *,
        action_is_pad: Any = None,
        instructions: list[str] | None = None,
        loss: Loss = "default",
        advantages: Any = None,
    ) -> CallFuture[s.ForwardBackwardResult]:
        call = _fb_call(images, state, action, action_is_pad, instructions, loss, advantages)
        return self._future(call, s.ForwardBackwardResult)

    def optim_step_async(self) -> CallFuture[s.OptimStepResult]:
        return self._future(FutureCallBuilders.submit(Calls.optim_step(), "optim_step"), s.OptimStepResult)

    def predict_async(
        self,
        images: Any,
        state: Any,
        *,
        instructions: list[str] | None = None,
        policy_version: int | None = None,
        seeds: list[int] | None = None,
        sample: bool = False,
    ) -> CallFuture[s.PredictResult]:
        call = _predict_call(images, state, instructions, policy_version, seeds, sample)
        return self._future(call, s.PredictResult)

    def sample(
        self,
        images: Any,
        state: Any,
        *,
        n: int = 1,
        temperature: float = 1.0,
        seed: int | None = None,
        instructions: list[str] | None = None,
    ) -> ss.SampleResult:
        """`n` action chunks per observation from the current training policy, with log-probs."""
        return self._run(FutureCallBuilders.sample(images, state, instructions, n, temperature, seed))

    def sample_async(
        self,
        images: Any,
        state: Any,
        *,
        n: int = 1,
        temperature: float = 1.0,
        seed: int | None = None,
        instructions: list[str] | None = None,
    ) -> CallFuture[ss.SampleResult]:
        blocking = FutureCallBuilders.sample(images, state, instructions, n, temperature, seed)
        return self._future(FutureCallBuilders.submit(blocking, "sample"), ss.SampleResult)

    def compute_logprobs(
        self, images: Any, state: Any, action: Any, *, action_is_pad: Any = None, instructions: list[str] | None = None
    ) -> ss.ComputeLogprobsResult:
        """log pi(action | obs) under the current training policy (no gradient, no new version)."""
        return self._run(FutureCallBuilders.compute_logprobs(images, state, action, action_is_pad, instructions))

    def compute_logprobs_async(
        self, images: Any, state: Any, action: Any, *, action_is_pad: Any = None, instructions: list[str] | None = None
    ) -> CallFuture[ss.ComputeLogprobsResult]:
        blocking = FutureCallBuilders.compute_logprobs(images, state, action, action_is_pad, instructions)
        return self._future(FutureCallBuilders.submit(blocking, "compute_logprobs"), ss.ComputeLogprobsResult)


class AsyncFutureCalls:
    """The futures and sampling calls of `AsyncJoyNexusClient` (module docstring)."""

    _run: Any

    async def _future(self, call: Call, model: type[R]) -> AsyncCallFuture[R]:
        return AsyncCallFuture(self, await self._run(call), model)

    async def forward_backward_async(
        self,
        images: Any,
        state: Any,
        action: Any,
        *,
        action_is_pad: Any = None,
        instructions: list[str] | None = None,
        loss: Loss = "default",
        advantages: Any = None,
    ) -> AsyncCallFuture[s.ForwardBackwardResult]:
        call = _fb_call(images, state, action, action_is_pad, instructions, loss, advantages)
        return await self._future(call, s.ForwardBackwardResult)

    async def optim_step_async(self) -> AsyncCallFuture[s.OptimStepResult]:
        return await self._future(FutureCallBuilders.submit(Calls.optim_step(), "optim_step"), s.OptimStepResult)

    async def predict_async(
        self,
        images: Any,
        state: Any,
        *,
        instructions: list[str] | None = None,
        policy_version: int | None = None,
        seeds: list[int] | None = None,
        sample: bool = False,
    ) -> AsyncCallFuture[s.PredictResult]:
        call = _predict_call(images, state, instructions, policy_version, seeds, sample)
        return await self._future(call, s.PredictResult)

    async def sample(
        self,
        images: Any,
        state: Any,
        *,
        n: int = 1,
        temperature: float = 1.0,
        seed: int | None = None,
        instructions: list[str] | None = None,
    ) -> ss.SampleResult:
        return await self._run(FutureCallBuilders.sample(images, state, instructions, n, temperature, seed))

    async def sample_async(
        self,
        images: Any,
        state: Any,
        *,
        n: int = 1,
        temperature: float = 1.0,
        seed: int | None = None,
        instructions: list[str] | None = None,
    ) -> AsyncCallFuture[ss.SampleResult]:
        blocking = FutureCallBuilders.sample(images, state, instructions, n, temperature, seed)
        return await self._future(FutureCallBuilders.submit(blocking, "sample"), ss.SampleResult)

    async def compute_logprobs(
        self, images: Any, state: Any, action: Any, *, action_is_pad: Any = None, instructions: list[str] | None = None
    ) -> ss.ComputeLogprobsResult:
        call = FutureCallBuilders.compute_logprobs(images, state, action, action_is_pad, instructions)
        return await self._run(call)

    async def compute_logprobs_async(
        self, images: Any, state: Any, action: Any, *, action_is_pad: Any = None, instructions: list[str] | None = None
    ) -> AsyncCallFuture[ss.ComputeLogprobsResult]:
        blocking = FutureCallBuilders.compute_logprobs(images, state, action, action_is_pad, instructions)
        return await self._future(FutureCallBuilders.submit(blocking, "compute_logprobs"), ss.ComputeLogprobsResult)
