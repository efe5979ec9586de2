"""Issue 41.3: forks cannot escape quotas. A fork inherits its source's quotas and its spend counts
against the owner of its line (the tenant whose key made the first fork); the owner lists and
deletes its forks; a bound on forks per owner; forks racing for one id get 409, not 500."""

from __future__ import annotations

import threading

import pytest

from joynexus.actors import handle_of
from tests.api.conftest import TenantHandle, wire


def fork(api, source: TenantHandle, new_id: str):
    return api.client.post("/v1/fork", json={"new_tenant": new_id}, headers=source.headers)


def forked(api, source: TenantHandle, new_id: str) -> TenantHandle:
    answer = fork(api, source, new_id)
    assert answer.status_code == 201, answer.text
    return TenantHandle(new_id, answer.json()["key"]["api_key"], source.spec)


def train(api, t: TenantHandle):
    return api.client.post("/v1/train_batch", json=wire(t.batch(4)), headers=t.headers)


def test_a_fork_inherits_its_sources_quota_and_spends_against_its_owner(api):
    source = api.tenant("fq-src")
    quota = {"max_device_seconds": 1e-9, "max_queued_workloads": 3}  # nothing spent yet: still admitted
    put = api.client.put(f"/v1/admin/tenants/{source.tenant_id}/quota", json=quota, headers=api.admin)
    assert put.status_code == 200, put.text
    child = forked(api, source, f"{source.tenant_id}-a")
    inherited = api.client.get("/v1/usage", headers=child.headers).json()["quota"]
    assert (inherited["max_device_seconds"], inherited["max_queued_workloads"]) == (1e-9, 3)
    assert train(api, child).status_code == 200  # the fork spends; the line is now over the owner's cap
    api.client.get("/v1/usage", headers=child.headers)  # flushes the meter
    for t in (child, source):  # the source spent nothing itself: its fork's spend counts against it
        refused = train(api, t)
        assert refused.status_code == 429, refused.text
        assert refused.json()["problems"][0]["field"] == "quota.max_device_seconds"
    assert "fork line" in refused.json()["message"] and child.tenant_id in refused.json()["message"]  # the source's
    other = api.tenant("fq-other")
    assert train(api, other).status_code == 200  # outside the line: untouched


def test_a_tenant_lists_and_deletes_its_own_forks_and_only_those(api):
    source, stranger = api.tenant("fl-src"), api.tenant("fl-stranger")
    child = forked(api, source, f"{source.tenant_id}-a")
    grandchild = forked(api, child, f"{source.tenant_id}-b")  # a fork of a fork: the same owner
    assert fork(api, source, f"{source.tenant_id}-c").json()["owner"] == source.tenant_id
    listed = api.client.get("/v1/forks", headers=source.headers).json()
    assert [f["tenant_id"] for f in listed["forks"]] == [child.tenant_id, grandchild.tenant_id, f"{source.tenant_id}-c"]
    assert listed["forks"][1]["source_tenant_id"] == child.tenant_id and listed["max_forks"] >= 3
    assert api.client.get("/v1/forks", headers=child.headers).json()["forks"] == []  # it owns none
    for caller, target in ((stranger, child), (child, grandchild), (child, source)):
        refused = api.client.delete(f"/v1/forks/{target.tenant_id}", headers=caller.headers)
        assert refused.status_code == 404, refused.text
    deleted = api.client.delete(f"/v1/forks/{grandchild.tenant_id}", headers=source.headers)
    assert deleted.status_code == 200, deleted.text
    assert api.client.get("/v1/tenant", headers=grandchild.headers).status_code == 401  # its key went with it
    assert api.cluster.checkpoints.versions(grandchild.tenant_id) == []  # and its checkpoint copy
    left = api.client.get("/v1/forks", headers=source.headers).json()["forks"]
    assert [f["tenant_id"] for f in left] == [child.tenant_id, f"{source.tenant_id}-c"]
    forked(api, source, grandchild.tenant_id)  # the id is free again


def test_forks_per_owner_are_bounded_forks_of_forks_included(api, monkeypatch):
    master = handle_of(api.cluster.master).target
    monkeypatch.setattr(master, "options", master.options.model_copy(update={"max_forks_per_tenant": 2}))
    source = api.tenant("fb-src")
    child = forked(api, source, f"{source.tenant_id}-1")
    forked(api, child, f"{source.tenant_id}-2")
    for caller, new_id in ((source, f"{source.tenant_id}-3"), (child, f"{source.tenant_id}-4")):
        refused = fork(api, caller, new_id)
        assert refused.status_code == 429, refused.text
        assert refused.json()["problems"][0]["field"] == "max_forks_per_tenant"
        assert new_id not in {t.tenant_id for t in api.cluster.master.list_tenants()}
        assert api.cluster.checkpoints.versions(new_id) == []
    assert api.client.delete(f"/v1/forks/{child.tenant_id}", headers=source.headers).status_code == 200
    forked(api, source, f"{source.tenant_id}-5")  # a deleted fork gives its place back


@pytest.mark.parametrize("racers", [4])
def test_forks_racing_for_one_id_get_one_201_and_409s(api, racers):
    source = api.tenant("fr-src")
    new_id = f"{source.tenant_id}-race"
    statuses: list[int] = []
    start = threading.Barrier(racers)

    def race() -> None:
        start.wait()
        statuses.append(fork(api, source, new_id).status_code)

    threads = [threading.Thread(target=race) for _ in range(racers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert sorted(statuses) == [201] + [409] * (racers - 1), statuses
    assert api.cluster.checkpoints.versions(new_id) == [0]
