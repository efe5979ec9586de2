"""Checkpoint store and tenant payload tests (CPU, tmp_path, no pickle anywhere)."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch

from joynexus.artifacts import (
    ACTION_MODULE_FILE,
    MANIFEST_FILE,
    OPTIMIZER_JSON_FILE,
    OPTIMIZER_TENSORS_FILE,
    CheckpointError,
    CheckpointStore,
    PayloadError,
    TenantManifest,
    decode_tenant_payload,
    encode_tenant_payload,
)
from joynexus.artifacts import blobs as artifacts


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, 4, generator=gen)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()


def _save(store: CheckpointStore, version: int, model: torch.nn.Module, opt=None, tenant: str = "acme"):
    return store.save_tenant(
        tenant_id=tenant,
        policy_version=version,
        schema_signature="obs:rgb64|act:7",
        base_model_id="tiny-vlm@abc123",
        module_kind="linear",
        module_config={"in_features": 4, "out_features": 3},
        module_state=model.state_dict(),
        optimizer_state=None if opt is None else opt.state_dict(),
        extra={"optimizer_steps": 2},
    )


def _manifest(**overrides) -> TenantManifest:
    fields = dict(
        tenant_id="acme",
        policy_version=3,
        schema_signature="sig",
        base_model_id="base",
        module_kind="linear",
        module_config={"in_features": 4, "out_features": 3},
        files={"action_module.safetensors": "00" * 32},
        created_at="2026-01-01T00:00:00+00:00",
        extra={"optimizer_steps": 12},
    )
    fields.update(overrides)
    return TenantManifest(**fields)


@pytest.fixture()
def store(tmp_path: Path) -> CheckpointStore:
    return CheckpointStore(tmp_path / "ckpt")


def test_round_trip_resumes_adam_exactly(store: CheckpointStore, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    _train(model, opt, steps=2, seed=1)
    manifest = _save(store, 1, model, opt)

    layout = tmp_path / "ckpt" / "tenants" / "acme"
    assert sorted(p.name for p in (layout / "v000001").iterdir()) == sorted(
        [ACTION_MODULE_FILE, OPTIMIZER_TENSORS_FILE, OPTIMIZER_JSON_FILE, MANIFEST_FILE]
    )
    assert (layout / "LATEST").read_text().strip() == "1"
    assert set(manifest.files) == {ACTION_MODULE_FILE, OPTIMIZER_TENSORS_FILE, OPTIMIZER_JSON_FILE}
    # No pickle on disk: every tensor file is safetensors, the rest JSON.
    for name in (ACTION_MODULE_FILE, OPTIMIZER_TENSORS_FILE):
        assert not (layout / "v000001" / name).read_bytes().startswith(b"\x80")

    loaded_manifest, state, opt_state = store.load_tenant("acme")
    assert loaded_manifest == manifest
    assert loaded_manifest.digest == manifest.digest
    for key, value in model.state_dict().items():
        assert torch.equal(state[key], value)
    assert opt_state is not None
    assert set(opt_state["state"]) == {0, 1}  # int parameter ids rebuilt
    assert opt_state["param_groups"][0]["betas"] == (0.9, 0.999)  # tuple preserved

    resumed = torch.nn.Linear(4, 3)
    resumed.load_state_dict(state)
    resumed_opt = torch.optim.Adam(resumed.parameters(), lr=1e-2)
    resumed_opt.load_state_dict(opt_state)

    _train(model, opt, steps=1, seed=2)
    _train(resumed, resumed_opt, steps=1, seed=2)
    for a, b in zip(model.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)


def test_without_optimizer(store: CheckpointStore) -> None:
    model = torch.nn.Linear(4, 3)
    manifest = _save(store, 0, model)
    assert set(manifest.files) == {ACTION_MODULE_FILE}
    _, _, opt_state = store.load_tenant("acme", 0)
    assert opt_state is None


def test_optimizer_state_before_first_step(store: CheckpointStore) -> None:
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _save(store, 1, model, opt)  # empty "state", only param_groups
    _, _, opt_state = store.load_tenant("acme")
    fresh = torch.optim.SGD(model.parameters(), lr=0.5)
    fresh.load_state_dict(opt_state)
    assert fresh.param_groups[0]["lr"] == 0.1


def test_latest_moves_and_versions(store: CheckpointStore) -> None:
    model = torch.nn.Linear(4, 3)
    assert store.latest_version("acme") is None
    assert store.versions("acme") == []
    assert store.tenants() == []
    with pytest.raises(CheckpointError, match="acme"):
        store.load_tenant("acme")

    _save(store, 1, model)
    with torch.no_grad():
        model.weight.add_(1.0)
    m2 = _save(store, 2, model)
    assert store.latest_version("acme") == 2
    assert store.versions("acme") == [1, 2]
    loaded, state, _ = store.load_tenant("acme")
    assert loaded.policy_version == 2 and loaded.digest == m2.digest
    assert torch.equal(state["weight"], model.weight)
    old, old_state, _ = store.load_tenant("acme", 1)
    assert old.policy_version == 1
    assert not torch.equal(old_state["weight"], model.weight)

    # An older version saved late never rolls LATEST back.
    _save(store, 0, model)
    assert store.versions("acme") == [0, 1, 2]
    assert store.latest_version("acme") == 2

    _save(store, 1, model, tenant="beta")
    assert store.tenants() == ["acme", "beta"]

    with pytest.raises(FileExistsError, match="immutable"):
        _save(store, 2, model)


def test_corrupted_file_names_the_file(store: CheckpointStore, tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters())
    _train(model, opt, steps=2, seed=0)
    _save(store, 7, model, opt)
    target = tmp_path / "ckpt" / "tenants" / "acme" / "v000007" / OPTIMIZER_TENSORS_FILE
    data = bytearray(target.read_bytes())
    data[-1] ^= 0xFF  # flip one byte of tensor data: still parses, only the hash can tell
    target.write_bytes(bytes(data))
    with pytest.raises(CheckpointError) as err:
        store.load_tenant("acme")
    msg = str(err.value)
    assert OPTIMIZER_TENSORS_FILE in msg and "'acme'" in msg and "version 7" in msg

    target.unlink()
    with pytest.raises(CheckpointError, match=f"{OPTIMIZER_TENSORS_FILE} is missing"):
        store.load_tenant("acme", 7)


def test_tampered_manifest_detected(store: CheckpointStore, tmp_path: Path) -> None:
    _save(store, 1, torch.nn.Linear(4, 3))
    path = tmp_path / "ckpt" / "tenants" / "acme" / "v000001" / MANIFEST_FILE
    path.write_text(path.read_text().replace('"policy_version": 1', '"policy_version": 9'))
    with pytest.raises(CheckpointError, match=MANIFEST_FILE):
        store.load_tenant("acme", 1)
    path.write_text("{not json")
    with pytest.raises(CheckpointError, match=MANIFEST_FILE):
        store.load_tenant("acme", 1)


def _assert_no_temp(tenant_dir: Path) -> None:
    leftovers = [p.name for p in tenant_dir.iterdir() if p.name.startswith(".tmp")]
    assert leftovers == []


def test_crash_during_rename_keeps_previous(store: CheckpointStore, tmp_path: Path, monkeypatch) -> None:
    model = torch.nn.Linear(4, 3)
    first = _save(store, 1, model)

    def boom(src, dst):
        raise OSError("simulated crash during rename")

    monkeypatch.setattr(os, "replace", boom)
    with torch.no_grad():
        model.weight.zero_()
    with pytest.raises(OSError, match="simulated crash"):
        _save(store, 2, model)
    monkeypatch.undo()

    tenant_dir = tmp_path / "ckpt" / "tenants" / "acme"
    _assert_no_temp(tenant_dir)
    assert not (tenant_dir / "v000002").exists()
    assert store.latest_version("acme") == 1
    assert store.versions("acme") == [1]
    loaded, _, _ = store.load_tenant("acme")
    assert loaded.digest == first.digest
    # The failed version can be saved again afterwards.
    _save(store, 2, model)
    assert store.latest_version("acme") == 2


def test_crash_while_writing_files(store: CheckpointStore, tmp_path: Path, monkeypatch) -> None:
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters())
    _train(model, opt, steps=1, seed=0)
    _save(store, 1, model, opt)
    real_write = artifacts._write_file_durably
    calls = {"n": 0}

    def flaky(path: Path, data: bytes) -> None:
        calls["n"] += 1
        if calls["n"] == 2:  # first file written, then the "crash"
            raise OSError("disk full")
        real_write(path, data)

    monkeypatch.setattr(artifacts, "_write_file_durably", flaky)
    with pytest.raises(OSError, match="disk full"):
        _save(store, 2, model, opt)
    monkeypatch.undo()
    _assert_no_temp(tmp_path / "ckpt" / "tenants" / "acme")
    assert store.versions("acme") == [1]
    assert store.latest_version("acme") == 1
    store.load_tenant("acme")


def test_crash_while_moving_latest(store: CheckpointStore, tmp_path: Path, monkeypatch) -> None:
    model = torch.nn.Linear(4, 3)
    _save(store, 1, model)
    real_replace = os.replace

    def fail_on_latest(src, dst):
        if Path(dst).name == "LATEST":
            raise OSError("crash before LATEST moved")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", fail_on_latest)
    with pytest.raises(OSError, match="LATEST"):
        _save(store, 2, model)
    monkeypatch.undo()
    _assert_no_temp(tmp_path / "ckpt" / "tenants" / "acme")
    # v2 is complete on disk but not committed: LATEST still names v1.
    assert store.latest_version("acme") == 1
    assert store.load_tenant("acme")[0].policy_version == 1


@pytest.mark.parametrize("bad", ["", "../evil", "a/b", "..", ".", "x" * 65, "semi;colon", "sp ace", "ü"])
def test_bad_tenant_ids_rejected(store: CheckpointStore, bad: str) -> None:
    with pytest.raises(ValueError, match="tenant_id"):
        _save(store, 1, torch.nn.Linear(4, 3), tenant=bad)
    with pytest.raises(ValueError, match="tenant_id"):
        store.load_tenant(bad)
    with pytest.raises(ValueError, match="tenant_id"):
        store.versions(bad)


def test_manifest_json_and_digest() -> None:
    m = _manifest()
    again = TenantManifest.from_json(m.to_json())
    assert again == m and again.digest == m.digest
    assert len(m.digest) == 64
    # The digest ignores key order but not content.
    reordered = _manifest(module_config={"out_features": 3, "in_features": 4})
    assert reordered.digest == m.digest
    assert _manifest(policy_version=4).digest != m.digest
    assert _manifest(extra={"optimizer_steps": 13}).digest != m.digest
    with pytest.raises(CheckpointError, match="missing fields"):
        TenantManifest.from_json('{"tenant_id": "acme"}')


def test_payload_round_trip() -> None:
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    model.half()
    m = _manifest()
    payload = encode_tenant_payload(model.state_dict(), m)
    assert isinstance(payload, bytes)
    state, manifest = decode_tenant_payload(payload)
    assert manifest == m and manifest.digest == m.digest
    assert state.keys() == model.state_dict().keys()
    for key, value in model.state_dict().items():
        assert state[key].dtype == torch.float16
        assert torch.equal(state[key], value)


def test_payload_with_tied_weights() -> None:
    shared = torch.nn.Linear(3, 3)
    state = {"a.weight": shared.weight, "b.weight": shared.weight}  # same storage
    out, _ = decode_tenant_payload(encode_tenant_payload(state, _manifest()))
    assert torch.equal(out["a.weight"], out["b.weight"])


@pytest.mark.parametrize(
    "junk",
    [
        b"",
        b"short",
        b"definitely not a safetensors file, just text",
        pickle.dumps({"weight": [1.0, 2.0]}),
        b"\x05\x00\x00\x00\x00\x00\x00\x00[1,2]",
    ],
)
def test_decode_junk_is_a_clear_error(junk: bytes) -> None:
    with pytest.raises(PayloadError, match="safetensors"):
        decode_tenant_payload(junk)


def test_decode_plain_safetensors_without_manifest() -> None:
    from safetensors.torch import save

    data = save({"w": torch.zeros(2)})
    with pytest.raises(PayloadError, match="not a JoyNexus tenant payload"):
        decode_tenant_payload(data)


def test_decode_truncated_payload() -> None:
    payload = encode_tenant_payload({"w": torch.arange(100.0)}, _manifest())
    with pytest.raises(PayloadError):
        decode_tenant_payload(payload[:-10])


def test_non_tensor_state_rejected() -> None:
    with pytest.raises(TypeError, match="not a torch.Tensor"):
        encode_tenant_payload({"w": [1.0, 2.0]}, _manifest())  # type: ignore[dict-item]
