"""Tenant density (issue 14.5): bounded resident tenant slots with LRU paging to disk.

The residency itself (LRU order, pins, byte bound, validated limits, concurrent use, atomic spill
files); the Training Model Service paging tenant slots out and back in bit-exact (module, AdamW
moments and step counts, LoRA adapter, counters), with pending gradients and grouped steps kept
resident; the Inference Model Service paging serving states out and in, serving identical actions,
never paging out a state whose request is queued; spill files deleted with the tenant."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from typing import Any

import numpy as np
import pytest
import torch

from joynexus.core.tenants import BaseModelCapabilities
from joynexus.models.backbone import BackboneSource
from joynexus.scheduling.inference_queue import Observation
from joynexus.services.inference.service import InferenceModelService
from joynexus.services.residency import LruCache, ResidencyLimits, TenantResidency, UnknownEntry
from joynexus.services.training.service import TrainingModelService, UnknownTenant
from tests.helpers import TINY_MODEL_ID, interface_config, random_microbatch
from tests.helpers import assert_state_equal as _equal

TASKS = ("pick up the cube", "", "open the top drawer")
# tenant -> (module kind, LoRA adapter or None): both module kinds, and an adapter tenant.
TENANTS: dict[str, tuple[str, dict[str, Any] | None]] = {
    "oft": ("oft_mlp", None),
    "flow": ("flow_matching", None),
    "lora": ("oft_mlp", {"kind": "lora", "rank": 2, "alpha": 4.0, "target_modules": ["q_proj", "v_proj"]}),
}


# ----------------------------------------------------------------------------- the residency
class _RowPager:
    """Entries are dicts holding one tensor; what was paged out and brought back is recorded."""

    immutable = False

    def __init__(self) -> None:
        self.paged_out: list[Any] = []
        self.rested: list[Any] = []
        self.refuse: set[Any] = set()

    def nbytes(self, value: dict[str, torch.Tensor]) -> int:
        return value["w"].numel() * value["w"].element_size()

    def can_page_out(self, key: Any, value: dict[str, torch.Tensor]) -> bool:
        return key not in self.refuse

    def spill(self, key: Any, value: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        return {"w": value["w"]}, {"key": repr(key)}

    def evicted(self, key: Any, value: dict[str, torch.Tensor]) -> None:
        self.paged_out.append(key)

    def restore(self, key: Any, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict[str, torch.Tensor]:
        assert meta == {"key": repr(key)}
        return {"w": tensors["w"]}

    def at_rest(self, key: Any, value: dict[str, torch.Tensor]) -> None:
        self.rested.append(key)


def _row(i: int, n: int = 16) -> dict[str, torch.Tensor]:
    return {"w": torch.arange(n, dtype=torch.float32) + 1000 * i}


def _residency(tmp_path, max_resident: int = 2, max_bytes: int | None = None) -> TenantResidency:
    return TenantResidency(_RowPager(), ResidencyLimits(max_resident, max_bytes), tmp_path, name="test")


def test_the_lru_cache_orders_by_use_and_evicts_through_its_hook():
    evicted: list[tuple[str, int]] = []
    cache: LruCache[str, int] = LruCache(on_evict=lambda key, value: evicted.append((key, value)))
    for i, key in enumerate("abc"):
        cache.put(key, i)
    assert cache.get("a") == 0 and cache.keys() == ["b", "c", "a"]  # get touches
    assert "b" in cache and cache.peek("b") == 1 and list(cache) == ["b", "c", "a"]  # in / peek do not
    assert cache.touch("b") and not cache.touch("zz") and cache.keys() == ["c", "a", "b"]
    cache.put("c", 5)  # replacing makes it the most recently used
    assert cache.keys() == ["a", "b", "c"] and cache.get("missing", -1) == -1
    assert cache.pop("a") == 0 and cache.pop("a") is None and not evicted  # pop skips the hook
    assert cache.evict_least_recent(unless=lambda key, _: key == "b") == ("c", 5) and evicted == [("c", 5)]
    assert cache.evict_least_recent(unless=lambda key, _: True) is None and len(cache) == 1

    bounded: LruCache[int, None] = LruCache(capacity=2, on_evict=lambda key, _: evicted.append((str(key), 0)))
    for key in (1, 2, 1, 3):
        bounded.put(key, None)
    assert bounded.keys() == [1, 3] and evicted[-1] == ("2", 0)
    with pytest.raises(ValueError, match="capacity"):
        LruCache(capacity=0)


def test_the_least_recently_used_entry_pages_out_and_comes_back_equal(tmp_path):
    residency = _residency(tmp_path)
    residency.add("a", _row(0))
    residency.add("b", _row(1))
    residency.use("a")  # b is now the least recently used
    residency.add("c", _row(2))
    assert residency.resident_keys() == ["a", "c"] and not residency.is_resident("b")
    assert residency.pager.paged_out == ["b"]
    assert sorted(residency) == ["a", "b", "c"] and len(residency) == 3 and "b" in residency
    assert [p.name for p in residency.spill_dir.iterdir()] == [p.name for p in residency.spill_dir.glob("b-*")]

    assert torch.equal(residency.use("b")["w"], _row(1)["w"])  # paged in, exact; a goes out
    assert residency.resident_keys() == ["c", "b"]
    stats = residency.stats()
    assert (stats["page_outs"], stats["page_ins"], stats["hits"], stats["resident"]) == (2, 1, 1, 2)
    assert stats["registered"] == 3 and stats["paged_out"] == 1
    # a mutable entry's file is dropped at page-in (stale from its first change on): only a's is left
    assert [p.name.split("-")[0] for p in residency.spill_dir.iterdir()] == ["a"]
    with pytest.raises(UnknownEntry, match="'zzz' is not registered"):
        residency.use("zzz")
    assert residency.remove("a") is None and "a" not in residency  # paged out: nothing resident to return
    assert list(residency.spill_dir.iterdir()) == []  # its file went with it
    residency.close()
    assert not residency.spill_dir.exists()


def test_pinned_entries_stay_until_their_scope_or_future_ends(tmp_path):
    residency = _residency(tmp_path)
    for i, key in enumerate("abc"):
        residency.add(key, _row(i))
    with residency.scope():
        for key in "abc":  # three pinned entries over a bound of two: the bound gives way
            residency.use(key)
        assert sorted(residency.resident_keys()) == ["a", "b", "c"]
        assert residency.stats()["over_bound"] >= 1 and residency.stats()["pinned"] == 3
        with residency.scope():  # a nested scope joins the outer one
            residency.use("a")
        assert residency.pins("a") == 2
    assert residency.resident_keys() == ["c", "a"]  # back within the bound: b was least recently used
    assert set(residency.pager.rested) == {"a", "b", "c"}

    future: Future = Future()
    with residency.scope() as scope:
        residency.use("c")
        scope.hold_until(future)  # like a queued request
    residency.use("a")
    residency.use("b")  # c is the least recently used, but pinned: a goes instead
    assert residency.resident_keys() == ["c", "b"] and residency.pins("c") == 1
    future.set_result(None)
    assert residency.pins("c") == 0
    residency.use("a")  # now c can go
    assert residency.resident_keys() == ["b", "a"]

    residency.pager.refuse.add("a")  # the pager's own reason to stay (pending gradients)
    residency.use("c")
    assert residency.is_resident("a") and not residency.is_resident("b")
    assert residency.page_out("a") is False


def test_the_byte_bound_pages_out_too(tmp_path):
    residency = _residency(tmp_path, max_resident=100, max_bytes=3 * 16 * 4)
    for i in range(5):
        residency.add(i, _row(i))
    assert residency.resident_keys() == [2, 3, 4] and residency.stats()["resident_bytes"] == 3 * 16 * 4


def test_spill_folders_of_dead_processes_are_swept_and_a_closed_residency_leaves_none(tmp_path):
    first = _residency(tmp_path)
    first.add("a", _row(0))
    first.add("b", _row(1))
    first.add("c", _row(2))  # a paged out: a file in first's folder
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(finished.stdout)
    host = first.spill_dir.name.split(f"-{os.getpid()}-")[0]  # test-<host>
    dead = tmp_path / f"{host}-{dead_pid}-leftover"
    dead.mkdir()
    (dead / "x.safetensors").write_bytes(b"stale")
    second = _residency(tmp_path)  # a new life on this host: the dead one's folder goes
    assert not dead.exists() and first.spill_dir.exists() and second.spill_dir != first.spill_dir
    first.close()
    second.close()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "limits, message",
    [
        (dict(max_resident=0), "max_resident: must be an integer >= 1, got 0"),
        (dict(max_resident=True), "max_resident: must be an integer >= 1, got True"),
        (dict(max_resident=2, max_resident_bytes=0), "max_resident_bytes: must be an integer >= 1 or None"),
        (dict(max_resident=2.5), "max_resident: must be an integer >= 1, got 2.5"),
    ],
)
def test_limits_are_validated_naming_the_field(limits, message):
    with pytest.raises(ValueError, match=message):
        ResidencyLimits(**limits)


def test_the_services_validate_their_bounds_naming_their_own_fields(tmp_path):
    with pytest.raises(ValueError, match="max_resident_tenants: must be an integer >= 1, got 0"):
        TrainingModelService(BackboneSource(preset="tiny"), tmp_path, max_resident_tenants=0, placement="cpu")
    with pytest.raises(ValueError, match="max_resident_serving_bytes: must be an integer >= 1 or None"):
        InferenceModelService(
            BackboneSource(preset="tiny"), start_worker=False, max_resident_serving_bytes=-5, placement="cpu"
        )


def test_concurrent_use_from_many_threads_keeps_entries_exact_and_the_bound(tmp_path):
    residency = _residency(tmp_path, max_resident=3)
    for i in range(12):
        residency.add(i, _row(i, n=256))
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            for _ in range(150):
                keys = [int(k) for k in rng.choice(12, size=2, replace=False)]
                with residency.scope():
                    values = [residency.use(k) for k in keys]
                    for k, value in zip(keys, values, strict=True):
                        assert residency.is_resident(k)  # pinned: nobody pages it out under us
                        assert torch.equal(value["w"], _row(k, n=256)["w"])
        except BaseException as error:  # noqa: BLE001 - reported by the main thread
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors[0]
    stats = residency.stats()
    assert stats["resident"] <= 3 and stats["pinned"] == 0 and stats["page_ins"] > 0
    assert stats["registered"] == 12 and stats["paged_out"] == 12 - stats["resident"]
    assert not list(residency.spill_dir.glob(".tmp-*"))  # every write was renamed into place


# ---------------------------------------------------------------------- Training Model Service
@pytest.fixture(scope="module")
def caps() -> BaseModelCapabilities:
    return BaseModelCapabilities(model_id=TINY_MODEL_ID, feature_dim=64, max_images=3, image_size=32)


def _config(name: str, caps: BaseModelCapabilities, seed: int) -> Any:
    kind, adapter = TENANTS[name]
    return interface_config(name, caps, kind, seed, adapter)


def _batch(config: Any, rows: int, seed: int) -> dict[str, Any]:
    return random_microbatch(config, rows, seed, tuple(TASKS))


def _training(tmp_path, name: str, caps, **kwargs: Any) -> tuple[TrainingModelService, dict[str, Any]]:
    service = TrainingModelService(
        BackboneSource(preset="tiny"), tmp_path / name, num_threads=1, placement="cpu", **kwargs
    )
    configs = {tenant: _config(tenant, caps, seed) for seed, tenant in enumerate(TENANTS, start=1)}
    for config in configs.values():
        service.add_tenant(config)
    return service, configs


def test_every_public_training_call_but_heartbeat_and_save_pins_its_slots():
    """The pins are method decorators (`pins_during_call`): a new public method must carry one too."""
    public = {
        name
        for name, member in vars(TrainingModelService).items()
        if not name.startswith("_") and callable(member) and not isinstance(member, staticmethod | type)
    }
    unpinned = {name for name in public if not hasattr(getattr(TrainingModelService, name), "__wrapped__")}
    assert unpinned == {"heartbeat", "save"}


def test_a_paged_out_slot_resumes_bit_exact(tmp_path, caps):
    """Train every tenant in turn with room for one slot (each step pages the last tenant out and
    this one in) == the same steps on a service that never pages; then a grouped step over more
    tenants than the bound, which keeps them all resident while it runs."""
    paged, configs = _training(tmp_path, "paged", caps, max_resident_tenants=1, spill_dir=tmp_path / "spill")
    resident, _ = _training(tmp_path, "resident", caps)
    assert paged.residency_stats()["resident"] == 1 and paged.tenants() == sorted(TENANTS)
    for step in range(2):
        for i, (name, config) in enumerate(configs.items()):
            batch = _batch(config, rows=3 + i, seed=10 * step + i)
            out_paged, out_resident = paged.train_batch(name, batch), resident.train_batch(name, batch)
            assert out_paged["loss"] == out_resident["loss"], (name, step)
    group = [(name, _batch(config, rows=2, seed=99 + i)) for i, (name, config) in enumerate(configs.items())]
    assert [r["loss"] for r in paged.train_group(group)] == [r["loss"] for r in resident.train_group(group)]

    stats = paged.residency_stats()
    assert stats["page_ins"] >= 6 and stats["page_outs"] >= 6 and stats["resident"] == 1
    assert stats["over_bound"] >= 1  # the group held three pinned slots over a bound of one
    for name in TENANTS:
        a, b = paged.tenant_state(name), resident.tenant_state(name)
        assert a["optimizer"]["state"], name  # AdamW moments and step counts exist and survived
        _equal(a, b, name)
        status_a, status_b = paged.tenant_status(name), resident.tenant_status(name)
        assert status_a == status_b and status_a["optimizer_steps"] == 3
    # the adapter tenant's adapter is on the shared backbone only while its slot is resident
    paged.policy_version("oft")
    assert "lora" not in paged.backbone.adapters and len(paged.backbone.adapters) == 0
    paged.policy_version("lora")
    assert "lora" in paged.backbone.adapters


def test_the_datasets_that_trained_a_slot_survive_paging_and_a_checkpoint_restore(tmp_path, caps):
    """A slot's dataset digests (issue 24: a version says which data trained it) are a counter like
    the others: paged out and in with the slot, written in every manifest, read back on resume."""
    first, second = "a" * 64, "b" * 64
    paged, configs = _training(tmp_path, "paged", caps, max_resident_tenants=1, spill_dir=tmp_path / "spill")
    with paged._slots.scope():
        slot = paged.slot_table.slot("oft")
        for digest in (first, second, first, None):  # used again: moves last; none: nothing to record
            slot.note_dataset({"dataset_sha256": digest})
    paged.train_batch("flow", _batch(configs["flow"], rows=2, seed=1))  # pages "oft" out
    assert paged.residency_stats()["resident"] == 1 and paged.residency_stats()["page_outs"] >= 1
    paged.train_batch("oft", _batch(configs["oft"], rows=2, seed=2))  # and back in
    [manifest] = paged.save(["oft"])
    assert manifest["extra"]["datasets"] == [second, first] and manifest["extra"]["dataset_sha256"] == first
    resumed = TrainingModelService(BackboneSource(preset="tiny"), tmp_path / "paged", num_threads=1, placement="cpu")
    resumed.add_tenant(configs["oft"])
    resumed.train_batch("oft", _batch(configs["oft"], rows=2, seed=3))
    [after] = resumed.save(["oft"])
    assert after["policy_version"] == manifest["policy_version"] + 1 and after["extra"]["datasets"] == [second, first]


def test_pending_gradients_keep_a_slot_resident_and_removal_deletes_its_spill_file(tmp_path, caps):
    paged, configs = _training(tmp_path, "paged", caps, max_resident_tenants=1)
    resident, _ = _training(tmp_path, "resident", caps)
    for service in (paged, resident):
        service.forward_backward("oft", _batch(configs["oft"], 4, seed=1))
        service.train_batch("flow", _batch(configs["flow"], 4, seed=2))  # would page "oft" out
    # "oft" is mid-step (gradients waiting for optim_step): it stays, and "flow" makes room instead
    assert paged._slots.resident_keys() == ["oft"]
    assert paged.optim_step("oft")["loss"] == resident.optim_step("oft")["loss"]
    _equal(paged.tenant_state("oft"), resident.tenant_state("oft"))
    # at rest (between calls) a slot holds no gradients: only its module and optimizer
    assert all(p.grad is None for p in paged._slots.peek("oft").module.parameters())

    spill = paged._slots.spill_dir
    assert not paged._slots.is_resident("lora") and list(spill.glob("lora-*"))
    assert paged.remove_tenant("lora") is True and not list(spill.glob("lora-*"))
    assert paged.remove_tenant("lora") is False
    with pytest.raises(UnknownTenant):
        paged.policy_version("lora")
    assert paged.tenants() == ["flow", "oft"]


# --------------------------------------------------------------------- Inference Model Service
@pytest.fixture(scope="module")
def payloads(tmp_path_factory, caps) -> dict[str, bytes]:
    """One trained version of each tenant, as export_params gives it."""
    service, configs = _training(tmp_path_factory.mktemp("payloads"), "train", caps)
    for i, (name, config) in enumerate(configs.items()):
        service.train_batch(name, _batch(config, 4, seed=i))
    return {name: service.export_params(name) for name in TENANTS}


def _observations(seed: int, rows: int = 2) -> list[Observation]:
    rng = np.random.default_rng(seed)
    return [
        Observation(images=(rng.random((3, 32, 32), dtype=np.float32),), state=rng.standard_normal(4), instruction=t)
        for t in TASKS[:rows]
    ]


def _inference(payloads: dict[str, bytes], **kwargs: Any) -> InferenceModelService:
    service = InferenceModelService(BackboneSource(preset="tiny"), num_threads=1, placement="cpu", **kwargs)
    for payload in payloads.values():
        service.load_weights(payload)
    return service


def test_a_paged_out_serving_state_serves_identical_actions(payloads, tmp_path):
    paged = _inference(payloads, max_resident_serving=1, spill_dir=tmp_path)
    resident = _inference(payloads)
    try:
        assert paged.residency_stats()["resident"] == 1 and paged.versions("oft") == [1]
        for round_ in range(2):
            for name in TENANTS:  # every request pages its tenant in and the last one out
                obs = _observations(round_)
                a = paged.predict(name, obs, seeds=[1, 2])
                b = resident.predict(name, obs, seeds=[1, 2])
                assert np.array_equal(a["actions"], b["actions"]), (name, round_)
                assert a["policy_version"] == b["policy_version"] == 1
        stats = paged.stats()["residency"]
        assert stats["page_ins"] >= 5 and stats["resident"] == 1
        # a serving state never changes: written once, later page-outs only drop it
        assert stats["files_written"] == len(TENANTS)
        # the adapter of a paged-out version left the backbone; only the resident one's is there
        assert len(paged.backbone.adapters) == (1 if paged._serving.is_resident(("lora", 1)) else 0)

        spill = paged._serving.spill_dir
        assert list(spill.glob("oft-1-*"))
        assert paged.remove_tenant("oft") == 1 and not list(spill.glob("oft-1-*"))
        assert paged.versions("oft") == [] and ("oft", 1) not in paged._serving
    finally:
        paged.close()
        resident.close()
    assert not spill.exists()


def test_a_paged_out_module_is_reused_only_once_nothing_holds_its_old_state(payloads):
    """Page-ins overwrite the module of an earlier paged-out state of the same architecture in place;
    never while that old state is still held (by a request that may be serving from it)."""
    paged = _inference(payloads, max_resident_serving=1, start_worker=False)
    resident = _inference(payloads, start_worker=False)
    try:
        held = paged._serving.use(("oft", 1))  # as a request in flight holds it
        weights = {k: v.clone() for k, v in held.module.state_dict().items()}
        old_module = held.module
        paged._serving.use(("flow", 1))  # "oft" pages out; its module becomes a spare
        lora = paged._serving.use(("lora", 1))  # same architecture as "oft": a spare would fit
        assert lora.module is not old_module  # but "oft"'s old state is still held
        _equal(held.module.state_dict(), weights)  # and keeps serving "oft"'s weights
        del held, lora
        oft = paged._serving.use(("oft", 1))  # "lora" pages out; "oft"'s old state is gone now
        assert oft.module is old_module  # its module was recycled, weights copied in place
        obs = _observations(5)
        want = resident.submit("oft", obs, seeds=[3, 4])
        resident.execute(resident.queue.collect_prefix(resident.max_batch_size, 0.0))
        got = paged.submit("oft", obs, seeds=[3, 4])
        paged.execute(paged.queue.collect_prefix(paged.max_batch_size, 0.0))
        assert np.array_equal(got.result(5)["actions"], want.result(5)["actions"])
    finally:
        paged.close()
        resident.close()


def test_a_queued_request_pins_its_serving_state_until_it_is_served(payloads):
    service = _inference(payloads, max_resident_serving=1, start_worker=False)
    try:
        futures = {name: service.submit(name, _observations(3)) for name in TENANTS}
        # three queued requests over a bound of one: all three states stay in memory
        assert all(service._serving.is_resident((name, 1)) for name in TENANTS)
        assert service.residency_stats()["pinned"] == 3
        batch = service.queue.collect_prefix(service.max_batch_size, 0.0)
        assert sorted(r.tenant_id for r in batch) == sorted(TENANTS)  # still one group-batched forward
        service.execute(batch)
        for name, future in futures.items():
            assert future.result(timeout=5)["tenant_id"] == name
        stats = _settled_stats(service)
        assert stats["pinned"] == 0 and stats["resident"] == 1  # settled: back within the bound
        with pytest.raises(ValueError, match="observations\\[0\\].state"):  # a refused submit leaves no pin
            service.submit("oft", [Observation(images=(np.zeros((3, 32, 32), np.float32),), state=np.zeros(3))])
        assert service.residency_stats()["pinned"] == 0
    finally:
        service.close()


def _settled_stats(service: Any, timeout_s: float = 5.0) -> dict[str, Any]:
    """residency_stats() once no request holds a pin: a pin is released by the request future's
    done-callback, which runs just after the waiting caller was woken with the result."""
    deadline = time.monotonic() + timeout_s
    while (stats := service.residency_stats())["pinned"] and time.monotonic() < deadline:
        time.sleep(0.01)
    return stats


def test_concurrent_predicts_across_paged_tenants_match_a_service_that_never_pages(payloads):
    paged = _inference(payloads, max_resident_serving=1, max_wait_ms=2.0)
    resident = _inference(payloads)
    expected = {
        (name, seed): resident.predict(name, _observations(seed), seeds=[seed, seed + 1])["actions"]
        for name in TENANTS
        for seed in range(3)
    }
    errors: list[BaseException] = []

    def client(name: str) -> None:
        try:
            for seed in (0, 1, 2, 0, 2):
                got = paged.predict(name, _observations(seed), seeds=[seed, seed + 1])["actions"]
                # Batched with whoever else is waiting: float noise of the batch composition (it is
                # there without paging too), never another tenant's or a stale module.
                np.testing.assert_allclose(got, expected[(name, seed)], rtol=0, atol=1e-5, err_msg=f"{name} {seed}")
        except BaseException as error:  # noqa: BLE001 - reported by the main thread
            errors.append(error)

    threads = [threading.Thread(target=client, args=(name,)) for name in TENANTS for _ in range(2)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert not errors, errors[0]
        stats = _settled_stats(paged)
        assert stats["pinned"] == 0 and stats["resident"] == 1 and stats["page_ins"] > 0
    finally:
        paged.close()
        resident.close()


def test_settings_read_the_bounds_from_the_environment(monkeypatch, tmp_path):
    from joynexus.settings import Settings

    monkeypatch.setenv("JOYNEXUS_DATA_DIR", str(tmp_path))
    defaults = Settings()
    assert (defaults.max_resident_tenants, defaults.max_resident_serving) == (256, 1024)
    assert defaults.resolved_spill_dir == tmp_path / "spill"
    monkeypatch.setenv("JOYNEXUS_MAX_RESIDENT_TENANTS", "12")
    monkeypatch.setenv("JOYNEXUS_SPILL_DIR", str(tmp_path / "fast-disk"))
    settings = Settings()
    assert settings.max_resident_tenants == 12 and settings.resolved_spill_dir == tmp_path / "fast-disk"
    monkeypatch.setenv("JOYNEXUS_MAX_RESIDENT_SERVING", "many")
    with pytest.raises(ValueError, match="JOYNEXUS_MAX_RESIDENT_SERVING: expected an integer, got 'many'"):
        Settings()
    monkeypatch.setenv("JOYNEXUS_MAX_RESIDENT_SERVING", "0")
    with pytest.raises(ValueError, match="max_resident_serving"):
        Settings()
