"""A flow run from the command line ends in ONE line when it fails for a reason it names (a refused
spec, a dataset that does not validate, a workload that failed): the reason, not Prefect's
tracebacks around it. Crashes (anything else) keep their tracebacks."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from flows.tasks import REFUSALS


class _RefusalsWithoutTraceback(logging.Filter):
    """Drops the traceback of a record whose exception is a refusal (its message says the reason)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], REFUSALS):
            record.exc_info, record.exc_text = None, None
        return True


@contextmanager
def refusals_in_one_line() -> Iterator[None]:
    """While it is open, Prefect's log handlers print a refusal's message without its traceback."""
    handlers = [h for name in ("prefect", "") for h in logging.getLogger(name).handlers]
    quiet = _RefusalsWithoutTraceback()
    for handler in handlers:
        handler.addFilter(quiet)
    try:
        yield
    finally:
        for handler in handlers:
            handler.removeFilter(quiet)


def run_or_exit(flow_call: Callable[[], Any], name: str) -> Any:
    """Run a flow (`flow_call` returns its final state); its result, or exit 1 after one line on
    stderr naming why it failed: `<name> failed: <reason>`."""
    with refusals_in_one_line():
        state = flow_call()
    if not state.is_failed() and not state.is_crashed():
        return state.result()
    error = state.result(raise_on_failure=False)
    if not isinstance(error, BaseException):
        print(f"{name} failed: {state.message}", file=sys.stderr)
    elif isinstance(error, REFUSALS):
        print(f"{name} failed: {_reason(error)}", file=sys.stderr)
    else:
        raise error  # a crash: its traceback is what a person needs
    raise SystemExit(1)


def _reason(error: BaseException) -> str:
    """The error's message on one line (a refused spec's field lines joined)."""
    text = str(error.args[0]) if isinstance(error, KeyError) and error.args else str(error)
    return " ".join(line.strip() for line in text.splitlines() if line.strip()) or type(error).__name__
