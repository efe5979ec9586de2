"""The chaos soak's short variant (benchmarks/chaos_soak.py): a few tenants with mixed SFT / RL /
eval workloads on Ray while every role is SIGKILLed in turn; no workload fails, every killed role
was restarted in place, every tenant made progress and no acknowledged version was lost."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray")

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "chaos_soak.py"


@pytest.mark.slow
def test_short_soak_loses_nothing_while_every_role_is_killed(tmp_path):
    spec = importlib.util.spec_from_file_location("chaos_soak", BENCHMARK)
    soak = importlib.util.module_from_spec(spec)
    sys.modules["chaos_soak"] = soak  # dataclasses look their module up there
    spec.loader.exec_module(soak)
    result = soak.run(tenants=3, seconds=100, kill_every_s=15, data_dir=tmp_path)
    soak.print_result(result)
    killed = {role for _, role, _ in result.faults}
    assert killed == set(soak.KILL_ORDER), result.faults
    for role in killed:
        assert result.restarts[role] >= 1, (role, result.restarts)
    assert result.lost == []
    assert all(not t.failed for t in result.tenants), [t.failed for t in result.tenants]
    assert all(t.completed_workloads >= 1 and t.jobs >= 1 for t in result.tenants)
    assert sum(len(t.acknowledged) for t in result.tenants) >= 3
