"""How lower-layer routes run their blocking work: through the caller tenant's rate limits,
in-flight bound and own worker threads (`joynexus.api.rate_limits`), training calls also through
the priority gate in front of the Training Model Service (`joynexus.api.priority_gate`).

The routes are `async def` on purpose: a sync route runs in the server's shared thread pool, which
one tenant's waiting calls could fill for everyone."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from fastapi import Request, Response

from joynexus.protocol import sampling_schemas as ss
from joynexus.protocol import schemas as s
from joynexus.protocol.wire import Tensor

R = TypeVar("R")


def rows(tensor: Tensor | None) -> int:
    """Samples a request tensor carries (its first dimension), for the samples/s bucket."""
    return tensor.shape[0] if tensor is not None and tensor.shape else 0


def batch_samples(batch: s.SampleBatch | s.ObservationBatch) -> int:
    return rows(batch.state)


def sampled_chunks(request: ss.SampleRequest) -> int:
    """A sample call's work: `n` chunks drawn for each observation."""
    return batch_samples(request.observations) * request.n


def column_rows(put: s.QueuePut) -> int:
    return max((len(column) if isinstance(column, list) else rows(column)) for column in put.columns.values())


async def call_limited(
    request: Request, tenant_id: str, answer: Callable[[], Response], *, samples: int = 0, training: bool = False
) -> Response:
    """`answer()` in one of the tenant's worker threads once its limits let it (429 otherwise);
    with `training`, in its tenant's priority turn for the Training Model Service."""
    state = request.app.state
    route = request.scope["path"]
    if not training:
        return await state.limiter.run(tenant_id, answer, samples=samples, route=route)
    turn = training_turn(request, tenant_id)
    return await state.limiter.run(tenant_id, lambda: turn(answer), samples=samples, route=route)


def training_turn(request: Request, tenant_id: str) -> Callable[[Callable[[], R]], R]:
    """Runs a function in the tenant's turn at the training gate (by its priority, tenants in
    turn within one): a whole call, or each slice of a sampling call (`gateway.sample`)."""
    gate, gateway = request.app.state.training_gate, request.app.state.gateway

    def turn(function: Callable[[], R]) -> R:
        priority = gateway.tenant(tenant_id).spec.scheduling.priority  # cached by the gateway
        return gate.call(priority, function, tenant=tenant_id)

    return turn
