"""The node replay of benchmarks/mixed_workload.py (the discrete-event part, no deployment): its
timing against a closed form, group batching across tenants, matched work, determinism."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "mixed_workload.py"


@pytest.fixture(scope="module")
def mw():
    spec = importlib.util.spec_from_file_location("mixed_workload_under_test", _PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


def _trace(mw, tenants, *, a=0.004, c=0.001, max_batch=32, max_wait=0.005, sft=None):
    return mw.NodeTrace(a, c, max_batch, max_wait, tuple(tenants), sft)


def test_one_synchronous_tenant_matches_the_closed_form(mw):
    # Constant times: every step waits T (n < B), one batch of n, one env step; then overhead, update, sync.
    n, horizon, env, update, sync, overhead, jobs = 4, 5, 0.010, 0.200, 0.030, 0.050, 3
    rl = mw.RLTrace("t", n, horizon, (env,), (update,), sync, overhead)
    trace = _trace(mw, [rl])
    result = mw.simulate(trace, mw.Layout(1, 1, 2), rl_tenants=[0], jobs=jobs, max_outstanding=1, max_rollouts=1)
    batch = trace.batch_s(n)
    rollout = horizon * (trace.max_wait_s + batch + env)
    # The window ends at the last update: the last sync is outside it.
    assert result.wall_s == pytest.approx(jobs * (rollout + overhead + update) + (jobs - 1) * sync)
    assert result.train_busy_s == pytest.approx(jobs * update)
    assert result.infer_busy_s == pytest.approx(jobs * horizon * batch)
    assert (result.batches, result.batch_samples) == (jobs * horizon, jobs * horizon * n)
    assert result.rl_updates == {"t": jobs}


def test_data_parallel_training_halves_update_time_not_busy_seconds(mw):
    rl = mw.RLTrace("t", 1, 1, (0.0,), (1.0,), 0.0)
    trace = _trace(mw, [rl], max_wait=0.0)
    one = mw.simulate(trace, mw.Layout(1, 1, 2), rl_tenants=[0], jobs=4, max_outstanding=1, max_rollouts=1)
    two = mw.simulate(trace, mw.Layout(2, 1, 2), rl_tenants=[0], jobs=4, max_outstanding=1, max_rollouts=1)
    assert one.train_busy_s == two.train_busy_s == pytest.approx(4.0)
    assert two.wall_s == pytest.approx(one.wall_s - 4 * 0.5)


def test_tenants_stepping_together_share_one_forward(mw):
    tenants = [mw.RLTrace(f"t{i}", 4, 6, (0.010,), (0.05,), 0.0) for i in range(3)]
    trace = _trace(mw, tenants)
    together = mw.simulate(trace, mw.Layout(2, 2, 4), rl_tenants=[0, 1, 2], jobs=2, max_outstanding=1)
    alone = mw.simulate(trace, mw.Layout(2, 2, 4), rl_tenants=[0], jobs=2, max_outstanding=1, max_rollouts=1)
    assert alone.batch_samples / alone.batches == 4
    assert together.batch_samples == 3 * alone.batch_samples  # the same requests ...
    assert together.batches < 3 * alone.batches  # ... in fewer, larger forwards
    assert together.infer_busy_s < 3 * alone.infer_busy_s  # the fixed cost a is paid once per forward
    # A batch never exceeds B: with B = 6 the 12 simultaneous samples need at least two forwards.
    capped = mw.simulate(_trace(mw, tenants, max_batch=6), mw.Layout(2, 2, 4), rl_tenants=[0, 1, 2], jobs=1)
    assert capped.batches >= 2 * 6 and capped.batch_samples == 3 * 4 * 6


def test_comparison_matches_the_work_and_is_deterministic(mw):
    tenants = [
        mw.RLTrace("a", 4, 8, (0.008, 0.012, 0.02), (0.10, 0.14), 0.01),
        mw.RLTrace("b", 2, 12, (0.004, 0.006), (0.06, 0.09), 0.01),
        mw.RLTrace("c", 4, 6, (0.03, 0.05), (0.12, 0.2), 0.01),
    ]
    trace = _trace(mw, tenants, sft=mw.SFTTrace((0.05, 0.07), 0.2))
    first = mw.compare_on_node(trace, jobs=20, seed=3, replay="test")
    again = mw.compare_on_node(trace, jobs=20, seed=3, replay="test")
    assert first.summary() == again.summary()
    assert first.joynexus.rl_updates == {"a": 20, "b": 20, "c": 20}
    assert [r.rl_updates for r in first.isolated[:3]] == [{"a": 20}, {"b": 20}, {"c": 20}]
    sft = first.isolated[3]
    assert sft.rl_updates == {} and sft.sft_jobs == first.joynexus.sft_jobs > 0  # the SFT work appended
    # Same draws both ways: each tenant's update seconds sum to the same busy time.
    assert sum(r.train_busy_s for r in first.isolated) == pytest.approx(first.joynexus.train_busy_s)
    # The shared node can never beat its own bound: the actor's work over its GPUs.
    assert first.joynexus.wall_s >= first.joynexus.train_busy_s / 2
    # Light tenants overlap on the shared node: less GPU time than one after another.
    assert first.efficiency > 1.0
    other_seed = mw.compare_on_node(trace, jobs=20, seed=4, replay="test")
    assert other_seed.joynexus.wall_s != first.joynexus.wall_s


def test_layout_parse_names_the_problem(mw):
    assert str(mw.Layout.parse("2-2-4")) == "2-2-4" and mw.Layout.parse("1-1-2").gpus == 4
    for bad in ("2-2", "2-0-4", "a-b-c"):
        with pytest.raises(ValueError, match="layout: expected three positive GPU counts"):
            mw.Layout.parse(bad)


def test_fit_affine_recovers_a_line(mw):
    a, c, r2 = mw.fit_affine([(b, 0.005 + 0.0007 * b) for b in (1, 2, 4, 8, 16)])
    assert a == pytest.approx(0.005) and c == pytest.approx(0.0007) and r2 == pytest.approx(1.0)


def test_a_trace_without_samples_or_with_negative_times_is_refused(mw):
    with pytest.raises(ValueError, match=r"rl\[t\]\.env_step_s: no recorded samples"):
        mw.RLTrace("t", 4, 8, (), (0.1,), 0.0)
    with pytest.raises(ValueError, match=r"rl\[t\]\.update_s: recorded times must be >= 0"):
        mw.RLTrace("t", 4, 8, (0.01,), (-0.1,), 0.0)
    with pytest.raises(ValueError, match=r"rl\[t\]\.samples_per_step: must be >= 1"):
        mw.RLTrace("t", 0, 8, (0.01,), (0.1,), 0.0)
    with pytest.raises(ValueError, match=r"sft\.interval_s: must be >= 0"):
        mw.SFTTrace((0.1,), -1.0)


def _stack(*frames: str, thread: str = "actor_loop") -> str:
    base = ["Thread._bootstrap (threading.py:1002)", "ActorLoop.run (joynexus/master/loops/actor_loop.py:141)"]
    return ";".join([f"thread (7): {thread}", *base, *frames])


def test_actor_loop_breakdown_sorts_py_spy_samples_by_category(mw, tmp_path):
    lines = {label: number for number, label in mw._step_call_lines().items()}
    train = next(n for label, n in lines.items() if label.startswith("train_job"))
    version = next(n for label, n in lines.items() if label.startswith("policy_version"))
    step = "ActorLoop.step (/x/joynexus/master/loops/actor_loop.py:{})"
    outcome = "TrainingWorkloads.on_outcome (joynexus/master/workloads/training.py:190)"
    raw = "\n".join([
        f"{_stack(step.format(train), 'remote_call (joynexus/actors.py:92)')} 300",
        f"{_stack(step.format(version), 'remote_call (joynexus/actors.py:92)')} 20",
        f"{_stack(step.format(99), outcome, 'TrainingWorkloads.publish_weights (w.py:1)', 'remote_call (r.py:1)')} 40",
        f"{_stack(step.format(99), outcome, 'ExperimentTracker.log_metrics (registry.py:184)')} 60",
        f"{_stack(step.format(99), outcome, 'WorkloadRecords.emit_many (w.py:2)')} 30",
        f"{_stack(step.format(99), 'TrainingScheduler.wait_for_ready (s.py:3)')} 50",
        "thread (8): rollout-producer-a;Thread._bootstrap (threading.py:1002);produce (w.py:9) 999",  # not the loop
        "garbage line without a count",
    ])  # fmt: skip
    profile = tmp_path / "master.pyspy.txt"
    profile.write_text(raw)
    out = mw.actor_loop_breakdown(profile, jobs=4)
    rate = mw.PROFILE_RATE_HZ
    assert out["actor_loop_seconds"] == pytest.approx(500 / rate)
    assert out["seconds"] == pytest.approx({
        "train_job (the Training Model Service training)": 300 / rate,
        "MLflow logging": 60 / rate,
        "waiting for a ready job (idle)": 50 / rate,
        "weight sync (export_params + load_weights)": 40 / rate,
        "events (store transaction)": 30 / rate,
        "policy_version call": 20 / rate,
    })  # fmt: skip
    assert out["ms_per_job"]["MLflow logging"] == pytest.approx(1000 * 60 / rate / 4)
    assert sum(out["share"].values()) == pytest.approx(1.0)
    empty = tmp_path / "empty.txt"
    empty.write_text(raw.splitlines()[6])
    with pytest.raises(RuntimeError, match="no actor-loop samples"):
        mw.actor_loop_breakdown(empty, jobs=1)


def test_an_unknown_deployment_mode_is_refused(mw, tmp_path):
    with pytest.raises(ValueError, match="mode: expected one of"), mw.open_deployment("threads", tmp_path):
        pass
