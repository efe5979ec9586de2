"""What the Inference Model Service attaches to a queued request, and how a request too large for
one backbone turn is split into chunks and joined again (issue 11)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from joynexus.scheduling.inference_queue import InferenceRequest, settle_future

if TYPE_CHECKING:
    from joynexus.services.inference.serving import ServingState


@dataclass
class Pinned:
    """What a queued request needs at execution time, resolved at submission (its `context`)."""

    state: ServingState
    seeds: list[int] | None
    sample: bool = False
    operation: str = "predict"  # what the usage entry is recorded as ("predict", "rollout", ...)
    split: SplitRequest | None = None  # set on each chunk of a split request
    chunk: int = 0  # this chunk's index within its split request


class SplitRequest:
    """The caller's side of a request split into chunks: gathers the chunks' results, in chunk
    order, into one result on the caller's future. The first chunk that fails fails the request;
    once the request is settled (or cancelled by its caller) its unserved chunks are taken out of
    the queue (`discard`, one pass) and cancelled, so an abandoned request leaves nothing queued."""

    def __init__(
        self,
        chunks: list[InferenceRequest],
        on_result: Callable[[SplitRequest, dict[str, Any]], None],
        discard: Callable[[list[InferenceRequest]], Any] | None = None,
    ) -> None:
        self.future: Future = Future()
        self.request_id = chunks[0].request_id
        self.enqueued_at = chunks[0].enqueued_at
        self._chunks = chunks
        self._results: list[dict[str, Any] | None] = [None] * len(chunks)
        self._remaining = len(chunks)
        self._lock = threading.Lock()
        self._on_result = on_result  # (split, joined result) -> None; settles self.future
        self._discard = discard  # the queue's: removes the chunks still waiting
        for index, chunk in enumerate(chunks):
            chunk.future.add_done_callback(lambda done, index=index: self._chunk_done(index, done))
        self.future.add_done_callback(self._cancel_chunks)

    def _chunk_done(self, index: int, done: Future) -> None:
        if done.cancelled():  # only we cancel chunks: the request is already settled
            return
        error = done.exception()
        with self._lock:
            if self.future.done():
                return
            if error is None:
                self._results[index] = done.result()
                self._remaining -= 1
                if self._remaining:
                    return
                joined = join_chunk_results(self._results)
        # Settled outside the lock: the caller's callbacks (and _cancel_chunks) run right here.
        if error is not None:
            settle_future(self.future, exception=error)
        else:
            self._on_result(self, joined)

    def _cancel_chunks(self, _: Future) -> None:
        if self._discard is not None:
            self._discard(self._chunks)
        for chunk in self._chunks:
            chunk.future.cancel()  # a no-op on the chunks already served


def join_chunk_results(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One result from a split request's chunk results, rows in chunk order."""

    def rows(key: str) -> np.ndarray | None:
        arrays = [part[key] for part in parts]
        return None if arrays[0] is None else np.concatenate(arrays)

    return {
        **parts[0],
        "actions": rows("actions"),
        "values": rows("values"),
        "log_probs": rows("log_probs"),
        "chains": rows("chains") if "chains" in parts[0] else None,
        "batch_samples": max(part["batch_samples"] for part in parts),  # the largest shared batch it rode in
        "device_seconds": sum(part["device_seconds"] for part in parts),
    }
