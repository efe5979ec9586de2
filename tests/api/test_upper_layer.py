"""Upper-layer endpoints: tenants from specs (admin), workloads (submit, follow, cancel, queue
position), spec submission, quotas and usage."""

from __future__ import annotations

import json
import time

import pytest

from tests.api.conftest import wire


def wait_done(api, tenant, workload_id, timeout_s=60.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = api.client.get(f"/v1/workloads/{workload_id}", headers=tenant.headers).json()
        if status["state"] in ("completed", "failed", "cancelled"):
            return status
        time.sleep(0.1)
    raise AssertionError(f"workload {workload_id} still {status['state']} after {timeout_s} s")


def fields(response) -> dict[str, str]:
    return {p["field"]: p["reason"] for p in response.json()["problems"]}


def test_a_malformed_spec_is_refused_with_every_field_path(api):
    spec = api.spec("bad-spec")
    spec["observation"]["action_dim"] = 0
    spec["observation"]["cameras"] = ["front", "front"]
    spec["training"]["microbatch_size"] = -1
    r = api.client.post("/v1/admin/tenants", json=spec, headers=api.admin)
    assert r.status_code == 422
    assert {"observation.action_dim", "observation.cameras", "training.microbatch_size"} <= set(fields(r))
    r = api.client.post("/v1/admin/tenants", json={**api.spec("bad-model"), "base_model": "gpt-9"}, headers=api.admin)
    assert r.status_code == 422 and "unknown base model 'gpt-9'" in fields(r)["base_model"]
    r = api.client.post("/v1/admin/tenants", json={**api.spec("bad-task"), "task": "dance"}, headers=api.admin)
    assert r.status_code == 422 and "task" in fields(r)


def test_a_tenant_is_created_once(api):
    spec = api.spec("dup")
    assert api.client.post("/v1/admin/tenants", json=spec, headers=api.admin).status_code == 201
    again = api.client.post("/v1/admin/tenants", json=spec, headers=api.admin)
    assert again.status_code == 409 and "already exists" in again.json()["message"]
    listed = api.client.get("/v1/admin/tenants", headers=api.admin).json()
    assert spec["tenant"] in {t["tenant_id"] for t in listed}


def test_an_sft_workload_runs_and_streams_its_progress(api):
    t = api.tenant("wl")
    r = api.client.post("/v1/workloads", json={"jobs": 2}, headers=t.headers)
    assert r.status_code == 202, r.text
    workload_id = r.json()["workload_id"]
    kinds, data = [], []
    with api.client.stream("GET", f"/v1/workloads/{workload_id}/stream", headers=t.headers) as stream:
        assert stream.headers["content-type"].startswith("text/event-stream")
        for line in stream.iter_lines():
            if line.startswith("event: "):
                kinds.append(line[7:])
            elif line.startswith("data: "):
                data.append(json.loads(line[6:]))
    assert kinds[0] == "queued" and kinds[-2:] == ["completed", "end"]
    assert kinds.count("job_completed") == 2 and "step" in kinds
    assert data[-1]["state"] == "completed" and data[-1]["completed_jobs"] == 2
    final = wait_done(api, t, workload_id)
    assert final["version"] == 2 and final["last_loss"] is not None and final["registered_version"] == 1
    events = api.client.get(f"/v1/workloads/{workload_id}/events", params={"after": 0}, headers=t.headers).json()
    seqs = [e["seq"] for e in events["events"]]
    assert seqs == sorted(seqs) and len(seqs) == len(kinds) - 1
    later = api.client.get(f"/v1/workloads/{workload_id}/events", params={"after": seqs[-2]}, headers=t.headers)
    assert [e["seq"] for e in later.json()["events"]] == seqs[-1:]
    assert [w["workload_id"] for w in api.client.get("/v1/workloads", headers=t.headers).json()] == [workload_id]
    # a completed workload's training is metered from its jobs, its checkpoint is stored
    usage = api.client.get("/v1/usage", headers=t.headers).json()
    assert usage["samples_trained"] == 2 * 16 and usage["device_seconds"]["training"] > 0 and usage["storage_bytes"] > 0
    versions = api.client.get("/v1/versions", headers=t.headers).json()
    assert versions["serving_versions"] == [2] and [c["version"] for c in versions["checkpoints"]][-1] == 2
    # The registered version's manifest_digest tag is the digest `versions` lists for policy version 2.
    from joynexus.registry import ExperimentTracker

    tags = ExperimentTracker(api.cluster.settings.resolved_mlflow_uri()).model_version_tags(t.tenant_id, 1)
    assert tags["policy_version"] == "2" and tags["manifest_digest"] == versions["checkpoints"][-1]["digest"]


def test_a_second_workload_waits_in_the_queue_with_its_position(api):
    t = api.tenant("q", jobs=50)
    first = api.client.post("/v1/workloads", json={"jobs": 50}, headers=t.headers).json()
    second = api.client.post("/v1/workloads", json={"jobs": 1}, headers=t.headers).json()
    assert first["state"] == "running" and (second["state"], second["position"]) == ("queued", 1)
    cancelled = api.client.post(f"/v1/workloads/{second['workload_id']}/cancel", headers=t.headers).json()
    assert cancelled["state"] == "cancelled" and cancelled["position"] is None
    api.client.post(f"/v1/workloads/{first['workload_id']}/cancel", headers=t.headers)
    # "failed" too: the WorkloadManager can record a producer's error racing the cancel (reported)
    assert wait_done(api, t, first["workload_id"])["state"] in ("cancelled", "failed")


def test_unsupported_tasks_and_mismatched_specs_are_422(api):
    t = api.tenant("task")
    r = api.client.post("/v1/workloads", json={"task": "rl", "jobs": 1}, headers=t.headers)
    assert r.status_code == 422 and "created for 'sft'" in fields(r)["task"]
    r = api.client.post("/v1/workloads", json={"task": "eval"}, headers=t.headers)
    assert r.status_code == 422 and "environment" in r.json()["message"]
    r = api.client.post("/v1/workloads", json={"jobs": 0}, headers=t.headers)
    assert r.status_code == 422 and "jobs" in fields(r)
    spec = dict(t.spec)
    r = api.client.post("/v1/workloads", json={"spec": {**spec, "tenant": "someone-else"}}, headers=t.headers)
    assert r.status_code == 422 and "must be your tenant" in fields(r)["spec.tenant"]
    other_interface = {**spec, "observation": {**spec["observation"], "action_dim": 4}}
    r = api.client.post("/v1/workloads", json={"spec": other_interface}, headers=t.headers)
    assert r.status_code == 422 and "new tenant" in fields(r)["spec.observation"]
    r = api.client.post("/v1/workloads", json={"spec": {**spec, "observation": "nope"}}, headers=t.headers)
    assert r.status_code == 422 and "spec.observation" in fields(r)
    ok = api.client.post("/v1/workloads", json={"spec": spec}, headers=t.headers)
    assert ok.status_code == 202 and ok.json()["target_jobs"] == spec["scheduling"]["completion_target"]
    wait_done(api, t, ok.json()["workload_id"])


def test_a_spend_cap_stops_admission_with_a_clear_message_until_raised(api):
    t = api.tenant("cap")
    batch = wire(t.batch(2))
    assert api.client.post("/v1/train_batch", json=batch, headers=t.headers).status_code == 200
    cap = {"max_device_seconds": 0.0}
    quota = api.client.put(f"/v1/admin/tenants/{t.tenant_id}/quota", json=cap, headers=api.admin)
    assert quota.json()["max_device_seconds"] == 0.0
    refused = api.client.post("/v1/train_batch", json=batch, headers=t.headers)
    assert refused.status_code == 429 and refused.json()["code"] == "quota_exceeded"
    assert "device-seconds" in refused.json()["message"] and "quota.max_device_seconds" in fields(refused)
    assert api.client.post("/v1/workloads", json={"jobs": 1}, headers=t.headers).status_code == 429
    bad = api.client.post("/v1/train_batch", json={**batch, "state": batch["images"]}, headers=t.headers)
    assert bad.status_code == 422  # bad input is reported as such, whatever the quota
    usage = api.client.get("/v1/usage", headers=t.headers).json()
    assert usage["remaining_device_seconds"] == 0.0 and usage["quota"]["max_device_seconds"] == 0.0
    api.client.put(f"/v1/admin/tenants/{t.tenant_id}/quota", json={}, headers=api.admin)
    assert api.client.post("/v1/train_batch", json=batch, headers=t.headers).status_code == 200


def test_waiting_workloads_are_bounded_by_quota(api):
    t = api.tenant("queued", jobs=50)
    api.client.put(f"/v1/admin/tenants/{t.tenant_id}/quota", json={"max_queued_workloads": 1}, headers=api.admin)
    running = api.client.post("/v1/workloads", json={"jobs": 50}, headers=t.headers).json()
    waiting = api.client.post("/v1/workloads", json={"jobs": 1}, headers=t.headers).json()
    refused = api.client.post("/v1/workloads", json={"jobs": 1}, headers=t.headers)
    assert refused.status_code == 429 and "already waiting" in refused.json()["message"]
    usage = api.client.get("/v1/usage", headers=t.headers).json()
    assert (usage["workloads_running"], usage["workloads_queued"]) == (1, 1)
    for status in (waiting, running):
        api.client.post(f"/v1/workloads/{status['workload_id']}/cancel", headers=t.headers)
    wait_done(api, t, running["workload_id"])


def test_quota_bad_values_and_admin_usage(api):
    t = api.tenant("quota")
    r = api.client.put(f"/v1/admin/tenants/{t.tenant_id}/quota", json={"max_device_seconds": -1}, headers=api.admin)
    assert r.status_code == 422 and "max_device_seconds" in fields(r)
    assert api.client.put("/v1/admin/tenants/nope/quota", json={}, headers=api.admin).status_code == 404
    rows = api.client.get("/v1/admin/usage", headers=api.admin).json()
    assert t.tenant_id in {row["tenant_id"] for row in rows}
    assert api.client.get("/v1/admin/usage", headers=t.headers).status_code == 403


@pytest.mark.parametrize("path", ["/v1/workloads/wl-000000000000", "/v1/workloads/x/events"])
def test_unknown_workloads_are_404(api, path):
    t = api.tenant("unknown")
    r = api.client.get(path, headers=t.headers)
    assert r.status_code == 404 and r.json()["code"] == "not_found"
