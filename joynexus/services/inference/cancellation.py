"""Cancelling an inference request by its caller's key (issue 26: abandoned predicts keep no work).

A caller that may give up on a request (an API server whose robot hung up) submits it with a
`request_key` of its own choosing and, when it gives up, calls `cancel(tenant_id, request_key)`:
the request's future is cancelled and the Inference Queue takes its entries (every chunk of a split
request) out at once. The cancel may overtake the submit (two calls to an actor, on different
threads): a key cancelled before its request arrives is remembered (bounded), and that request is
cancelled as it is submitted.

On a Ray actor the cancel is sent in the actor's `health` concurrency group, beside the predicts:
those block the actor's default threads while they wait in the queue, and a cancel queued behind
them would only run once they were answered.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future
from typing import Any

from joynexus.actors import handle_of

REMEMBERED_EARLY_CANCELS = 4096  # keys cancelled before their request arrived, newest kept
CANCEL_TIMEOUT_S = 10.0

_Key = tuple[str, str]  # (tenant id, request key): a tenant can only cancel its own requests


class KeyedRequests:
    """The pending requests submitted with a key, by (tenant, key). Thread-safe."""

    def __init__(self, remember: int = REMEMBERED_EARLY_CANCELS) -> None:
        self._lock = threading.Lock()
        self._pending: dict[_Key, Future] = {}
        self._cancelled_early: OrderedDict[_Key, None] = OrderedDict()
        self._remember = remember

    @staticmethod
    def check(request_key: str) -> None:
        if not isinstance(request_key, str) or not 0 < len(request_key) <= 128:
            raise ValueError(f"request_key: expected 1..128 characters, got {request_key!r}")

    def register(self, tenant_id: str, request_key: str, future: Future) -> None:
        """Track `future` until it settles; cancel it now if its key was cancelled already."""
        self.check(request_key)
        key = (tenant_id, request_key)
        with self._lock:
            early = key in self._cancelled_early
            if early:
                del self._cancelled_early[key]
            else:
                self._pending[key] = future
        if early:
            future.cancel()
            return
        future.add_done_callback(lambda done: self._forget(key, done))

    def cancel(self, tenant_id: str, request_key: str) -> bool:
        """Cancel the tenant's request of this key; True if a waiting request was cancelled.
        An unknown key is remembered, so the request it names is cancelled when it arrives."""
        key = (tenant_id, request_key)
        with self._lock:
            future = self._pending.pop(key, None)
            if future is None:
                self._cancelled_early[key] = None
                while len(self._cancelled_early) > self._remember:
                    self._cancelled_early.popitem(last=False)
                return False
        return future.cancel()

    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def _forget(self, key: _Key, done: Future) -> None:
        with self._lock:
            if self._pending.get(key) is done:
                del self._pending[key]


def cancel_request(
    service: Any, tenant_id: str, request_key: str, *, wait: bool = True, timeout_s: float = CANCEL_TIMEOUT_S
) -> bool:
    """`service.cancel(tenant_id, request_key)`: on a Ray actor in its `health` group (see above);
    `wait` False sends it without waiting for the answer (then the result is True)."""
    cancelled = handle_of(service).probe("cancel", timeout_s, tenant_id, request_key, wait=wait)
    return True if cancelled is None else bool(cancelled)
