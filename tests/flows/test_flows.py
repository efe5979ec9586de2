"""The Prefect flows on an in-process deployment: a one-job SFT tenant that is evaluated in
gym-pusht (PushT-reach) goes through the whole lifecycle twice, then the periodic evaluation
evaluates its champion, fetched back from the registry, and logs the tenant's history."""

from __future__ import annotations

import pytest

from joynexus.registry import CANDIDATE_ALIAS, CHAMPION_ALIAS, HISTORY_TASK_TAG
from tests.helpers import sft_spec, write_dataset_for

pytest.importorskip("gym_pusht")

REACH_ENVIRONMENT = {"simulator": "pusht", "task": "PushT-reach-v0", "num_envs": 1, "horizon": 4}


def reach_spec(tenant: str, root, *, environment: bool = True) -> dict:
    """An SFT tenant shaped for PushT-reach (one top camera, state 4, action 2), on generated data."""
    spec = sft_spec(
        tenant, root, cameras=("top",), state_dim=4, action_dim=2, action_chunk=1,
        jobs=1, samples_per_job=8, microbatch_size=8,
    )  # fmt: skip
    if environment:
        spec["environment"] = REACH_ENVIRONMENT
        spec["promotion"] = {"eval_episodes": 1}  # the Master's promotion measures one episode
    return spec


class Handles:
    def __init__(self, cluster):
        from flows.tasks import shared_tracker

        self.cluster = cluster
        self.master = cluster.master
        shared_tracker.cache_clear()
        self.tracker = shared_tracker()


@pytest.fixture(scope="module")
def handles(prefect_api, tmp_path_factory):
    from joynexus.connect import in_process, use_cluster
    from joynexus.settings import Settings

    root = tmp_path_factory.mktemp("flows")
    cluster = in_process(Settings(data_dir=root / "data", torch_threads=1))
    previous = use_cluster(cluster)
    try:
        yield Handles(cluster)
    finally:
        use_cluster(previous)
        cluster.close()


@pytest.fixture(scope="module")
def reacher(handles, tmp_path_factory):
    spec = reach_spec("reacher", tmp_path_factory.mktemp("reacher-data") / "ds")
    write_dataset_for(spec, episodes=2, length=8)
    return spec


def task_runs(flow_state) -> dict[str, list]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_state.state_details.flow_run_id]))
        )
    found: dict[str, list] = {}
    for run in runs:
        found.setdefault(run.name.rsplit("-", 1)[0], []).append(run)  # "<task name>-<suffix>"
    return found


def test_lifecycle_creates_trains_evaluates_registers_and_promotes(handles, reacher):
    from flows.tenant_lifecycle import tenant_lifecycle

    state = tenant_lifecycle(reacher, return_state=True)
    assert state.is_completed(), state.message
    result = state.result()
    assert result["tenant"]["task"] == "sft" and result["tenant"]["has_environment"]
    training = result["training"]
    assert training["state"] == "completed" and training["completed_jobs"] == 1
    assert training["registered_version"] == 1
    evaluation = result["evaluation"]  # measured by the Master's promotion at publish
    assert evaluation["policy_version"] == training["version"] and evaluation["metric"] == "eval/success_ci_low"
    assert 0.0 <= evaluation["value"] <= 1.0
    decision = result["promotion"]
    assert decision["promoted"] and decision["reason"] == "no champion yet"
    assert training["result"]["promotion"] == decision  # the flow read back the workload's decision

    tracker = handles.tracker
    assert tracker.alias_version("reacher", CANDIDATE_ALIAS) == tracker.alias_version("reacher", CHAMPION_ALIAS) == 1
    # the rule compares the 95% interval's lower bound (issue 27), logged beside the success rate
    assert tracker.evaluation_metric("reacher", 1, "eval/success_ci_low") == evaluation["value"]
    runs = task_runs(state)
    assert {"create-tenant", "train"} <= set(runs) and "promote" not in runs  # the workload promoted it
    assert all(r.state.is_completed() for rs in runs.values() for r in rs)


def test_a_second_run_reuses_the_tenant_and_moves_only_the_candidate_unless_it_wins(handles, reacher):
    from flows.tenant_lifecycle import tenant_lifecycle

    state = tenant_lifecycle(reacher, return_state=True)
    assert state.is_completed(), state.message
    result = state.result()
    assert result["training"]["registered_version"] == 2
    assert result["training"]["version"] > 1  # the slot resumed from its checkpoint, then trained on
    create = task_runs(state)["create-tenant"][0]
    assert create.state.name == "Cached"  # same spec, same store: Prefect's cache skips validation
    decision = result["promotion"]
    tracker = handles.tracker
    assert tracker.alias_version("reacher", CANDIDATE_ALIAS) == 2
    assert tracker.alias_version("reacher", CHAMPION_ALIAS) == (2 if decision["promoted"] else 1)
    assert decision["promoted"] == (decision["value"] > decision["champion_value"])


def test_periodic_evaluation_evaluates_the_pinned_champion_and_logs_its_history(handles, reacher, tmp_path):
    from flows.periodic_evaluation import periodic_evaluation

    no_env = reach_spec("no-env", tmp_path / "ds", environment=False)
    write_dataset_for(no_env, episodes=2, length=8)
    handles.master.create_tenant(no_env)

    champion = handles.tracker.alias_version("reacher", CHAMPION_ALIAS)
    results = periodic_evaluation(episodes=1)
    assert results["no-env"] == {"status": "skipped", "reason": "no candidate alias"}  # never trained
    entry = results["reacher"]
    assert entry["status"] == "evaluated" and entry["registry_version"] == champion
    tags = handles.tracker.model_version_tags("reacher", champion)
    assert entry["policy_version"] == int(tags["policy_version"])
    assert entry["evaluation"]["policy_version"] == entry["policy_version"]
    assert tags["eval/success_rate"] == str(entry["evaluation"]["success_rate"])

    history = handles.tracker.client.get_run(entry["history_run"])
    assert history.data.tags["task"] == HISTORY_TASK_TAG and history.data.tags["tenant_id"] == "reacher"
    assert handles.tracker.metric_history(entry["history_run"], "registry_version") == [(0, float(champion))]
    again = periodic_evaluation(tenants=["reacher"], episodes=1)
    assert again["reacher"]["history_run"] == entry["history_run"]
    assert len(handles.tracker.metric_history(entry["history_run"], "eval/success_rate")) == 2


def test_a_bad_spec_fails_at_create_tenant_without_retrying(handles, tmp_path):
    from flows.tenant_lifecycle import tenant_lifecycle

    spec = reach_spec("broken", tmp_path / "missing-dataset")  # no dataset written there
    state = tenant_lifecycle(spec, return_state=True)
    assert state.is_failed()
    assert "dataset" in str(state.message) or "dataset" in repr(state.result(raise_on_failure=False))
    create = task_runs(state)["create-tenant"][0]
    assert create.state.is_failed() and create.run_count == 1  # a spec error is not transient
    assert "train" not in task_runs(state)


def test_a_refused_spec_from_the_command_line_is_one_line_not_a_traceback(handles, tmp_path, capfd):
    import yaml

    from flows.tenant_lifecycle import main

    spec_file = tmp_path / "broken.yaml"
    spec_file.write_text(yaml.safe_dump(reach_spec("broken-cli", tmp_path / "missing-dataset")))
    with pytest.raises(SystemExit) as exited:
        main([str(spec_file)])
    assert exited.value.code == 1
    captured = capfd.readouterr()
    output = captured.out + captured.err
    assert "Traceback" not in output, output
    failed = [line for line in captured.err.splitlines() if line.startswith("tenant-lifecycle failed: ")]
    assert len(failed) == 1 and "dataset" in failed[0], captured.err


def test_the_lifecycle_runs_a_lerobot_smolvla_tenant(handles, tmp_path):
    """A lab's LeRobot SmolVLA checkpoint (over the deployment's tiny VLM) through the whole
    lifecycle flow: created, fine-tuned, evaluated in PushT-reach, registered, promoted."""
    from flows.tenant_lifecycle import tenant_lifecycle
    from joynexus.artifacts.lerobot_smolvla import build_lerobot_smolvla_checkpoint
    from joynexus.models.backbone import ResidentBackbone

    small = dict(chunk_size=1, n_action_steps=1, num_steps=2, num_vlm_layers=2, max_state_dim=8, max_action_dim=4)
    checkpoint = build_lerobot_smolvla_checkpoint(
        tmp_path / "smolvla", ResidentBackbone.build_tiny(), camera_shapes={"observation.images.top": (3, 32, 32)},
        state_dim=4, action_dim=2, tokenizer_max_length=16, resize_imgs_with_padding=(32, 32), **small,
    )  # fmt: skip
    spec = reach_spec("smolvla-reacher", tmp_path / "ds")
    write_dataset_for(spec, episodes=2, length=8)
    spec["action_module"] = {"kind": "smolvla", "checkpoint": str(checkpoint)}
    state = tenant_lifecycle(spec, return_state=True)
    assert state.is_completed(), state.message
    result = state.result()
    assert result["training"]["state"] == "completed" and result["training"]["registered_version"] == 1
    assert result["evaluation"]["policy_version"] == result["training"]["version"]
    assert handles.tracker.alias_version("smolvla-reacher", CANDIDATE_ALIAS) == 1
