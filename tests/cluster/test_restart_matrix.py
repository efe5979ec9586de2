"""The restart matrix (tests/cluster/restart_matrix.py): for each restart path — API server kill,
Master kill, inference kill, training kill, whole Ray, down + up — no call answers a 5xx other than
503 with Retry-After, every tenant's served and pinned versions are the same after, and the
workload running through the fault completes every job (issue 26)."""

from __future__ import annotations

import pytest

pytest.importorskip("ray")


@pytest.mark.slow
def test_every_restart_path_keeps_answers_serving_sets_and_workloads(tmp_path):
    from tests.cluster.restart_matrix import PATHS, report_line, run

    results = run(tmp_path)
    assert [r.path for r in results] == list(PATHS)
    failed = [report_line(r) for r in results if not r.ok]
    assert not failed, "\n".join(failed)
