"""Fixtures of the dataset tests."""

from __future__ import annotations

import sys

import pytest


@pytest.fixture
def without_torchcodec(monkeypatch: pytest.MonkeyPatch):
    """This process as it is where torchcodec is not installed: `import torchcodec` fails (the
    state of a machine that never ran scripts/bootstrap's torchcodec step)."""
    from joynexus.data.lerobot_dataset import video_decoding_problem

    for name in [n for n in sys.modules if n == "torchcodec" or n.startswith("torchcodec.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "torchcodec", None)  # None in sys.modules: ImportError on import
    video_decoding_problem.cache_clear()
    yield
    monkeypatch.undo()
    video_decoding_problem.cache_clear()
