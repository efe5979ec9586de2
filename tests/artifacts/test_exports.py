"""Exports that stock tools load (issue 15.2): every export of one version is the same bytes (the
payload and the export directory), a checkpointed version exports what the live slot exported, the
registry's digest tags are the export's digests, the action module loads with stock safetensors,
and a LoRA tenant's adapter directory loads with `PeftModel.from_pretrained` onto the saved base
model and computes what our backbone computes."""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

import pytest  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load as st_load  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from joynexus.artifacts import decode_tenant_payload, payload_digest  # noqa: E402
from joynexus.artifacts.codec import _save_tensors  # noqa: E402
from joynexus.artifacts.exports import (  # noqa: E402
    ACTION_MODULE_DIR,
    ADAPTER_DIR,
    EXPORT_INFO_FILE,
    checkpoint_payload,
    export_directory,
    load_action_module,
)
from joynexus.models.action_modules import build_action_module  # noqa: E402
from joynexus.models.backbone import (
    BackboneSource,
    ResidentBackbone,  # noqa: E402
)
from joynexus.services.training.service import TrainingModelService
from tests.helpers import compiled_config, random_microbatch  # noqa: E402

LORA = {"kind": "lora", "rank": 4, "alpha": 8.0, "target_modules": ["k_proj", "q_proj", "up_proj"], "dropout": 0.0}
TEXTS = ["pick up the cube", "push the t-shaped block into the goal region", ""]


def _batch(config: Any, rows: int, seed: int) -> dict[str, Any]:
    return random_microbatch(config, rows, seed, tuple(TEXTS))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A service with a plain tenant and a LoRA tenant, each trained two steps and checkpointed."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("exports")
    service = TrainingModelService(BackboneSource(preset="tiny"), root / "ckpt")
    caps = service.capabilities()
    configs = {
        "plain": compiled_config("plain", caps, module="flow_matching").model_copy(update={"seed": 1}),
        "lora": compiled_config("lora", caps).model_copy(update={"seed": 2, "adapter": LORA}),
    }
    for config in configs.values():
        service.add_tenant(config)
        for step in range(2):
            service.train_batch(config.tenant_id, _batch(config, 4, step))
    service.save()
    return {"service": service, "configs": configs, "root": root}


def test_safetensors_bytes_do_not_depend_on_metadata_order():
    tensors = {"b": torch.arange(4.0), "a": torch.ones(2, 3, dtype=torch.float64), "c": torch.zeros(1)}
    metadata = {f"key{i}": f"value {i}" for i in range(12)}
    blobs = {_save_tensors(tensors, metadata) for _ in range(8)}
    blobs.add(_save_tensors(tensors, dict(reversed(metadata.items()))))
    assert len(blobs) == 1
    data = blobs.pop()
    loaded = st_load(data)  # the stock loader reads the rewritten header
    assert loaded.keys() == tensors.keys() and all(torch.equal(loaded[k], tensors[k]) for k in tensors)
    header_len = int.from_bytes(data[:8], "little")
    assert (8 + header_len) % 8 == 0  # data stays 8-byte aligned
    assert json.loads(data[8 : 8 + header_len])["__metadata__"] == metadata


@pytest.mark.parametrize("tenant", ["plain", "lora"])
def test_exports_of_one_version_are_byte_identical(trained, tenant, tmp_path):
    service = trained["service"]
    first = service.export_params(tenant)
    assert service.export_params(tenant) == first
    _, manifest = decode_tenant_payload(first)
    assert manifest.created_at == manifest.extra["version_created_at"]  # the version's time, not the export's
    # The checkpoint of this version exports the same bytes (what the API does for older versions).
    assert checkpoint_payload(service.checkpoints, tenant, manifest.policy_version) == first
    # So does a restarted service restoring it.
    shutil.copytree(trained["root"] / "ckpt", tmp_path / "ckpt")
    restarted = TrainingModelService(BackboneSource(preset="tiny"), tmp_path / "ckpt")
    restarted.add_tenant(trained["configs"][tenant])
    assert restarted.export_params(tenant) == first
    # A new version is a new export.
    restarted.train_batch(tenant, _batch(trained["configs"][tenant], 4, 7))
    assert restarted.export_params(tenant) != first


def test_export_directories_are_deterministic_and_their_digests_are_the_registry_tags(trained, tmp_path):
    from joynexus.registry import ExperimentTracker
    from joynexus.settings import local_tracking_uri

    service = trained["service"]
    payload = service.export_params("lora")
    one = export_directory(payload, tmp_path / "one")
    two = export_directory(service.export_params("lora"), tmp_path / "two")
    names = sorted(str(p.relative_to(tmp_path / "one")) for p in (tmp_path / "one").rglob("*") if p.is_file())
    assert names == [
        "action_module/config.json",
        "action_module/model.safetensors",
        "adapter/adapter_config.json",
        "adapter/adapter_model.safetensors",
        EXPORT_INFO_FILE,
    ]
    for name in names:
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes(), name
    assert one.files == two.files and one.manifest_digest == two.manifest_digest
    info = json.loads((tmp_path / "one" / EXPORT_INFO_FILE).read_text())
    assert info["manifest_digest"] == decode_tenant_payload(payload)[1].digest
    assert info["payload_sha256"] == payload_digest(payload)
    with pytest.raises(FileExistsError):
        export_directory(payload, tmp_path / "one")

    tracker = ExperimentTracker(local_tracking_uri(tmp_path / "mlflow"))
    run_id = tracker.start_workload_run("lora", "w-1", {})
    _, manifest = decode_tenant_payload(payload)
    registered = tracker.register_tenant_payload(run_id=run_id, tenant_id="lora", payload=payload, manifest=manifest)
    tags = tracker.model_version_tags("lora", registered)
    later = service.export_params("lora")  # exported again later: the same digests
    assert tags["manifest_digest"] == decode_tenant_payload(later)[1].digest == one.manifest_digest
    assert tags["payload_sha256"] == payload_digest(later) == one.payload_sha256
    fetched, _ = tracker.fetch_tenant_payload("lora", version=registered)
    assert fetched == later


def test_the_action_module_loads_with_stock_safetensors(trained, tmp_path):
    service = trained["service"]
    info = export_directory(service.export_params("plain"), tmp_path / "plain")
    assert not (tmp_path / "plain" / ADAPTER_DIR).exists()  # no adapter, no adapter directory
    root = tmp_path / "plain" / ACTION_MODULE_DIR
    # The documented recipe, spelled out: json + safetensors.torch.load_file + the registry.
    config = json.loads((root / "config.json").read_text())
    assert config["policy_version"] == info.manifest.policy_version and config["tenant_id"] == "plain"
    module = build_action_module(config["action_module"])
    module.load_state_dict(load_file(str(root / "model.safetensors")))
    module.eval()
    ours = service._slot("plain").module
    cfg = trained["configs"]["plain"]
    data = _batch(cfg, 3, 11)
    images = [[torch.as_tensor(c) for c in sample] for sample in data["images"]]
    features = service.backbone.encode(images, data["task"])
    state = torch.as_tensor(data["state"])
    expected = ours.predict(features, state, generator=torch.Generator().manual_seed(5))
    for loaded in (module, load_action_module(tmp_path / "plain")):
        got = loaded.predict(features, state, generator=torch.Generator().manual_seed(5))
        # Same weights; the slot's module is in train mode (other attention kernels), so not bitwise.
        assert torch.allclose(got, expected, rtol=0, atol=1e-5)


def test_the_lora_adapter_directory_loads_with_peft_onto_the_saved_base(trained, tmp_path):
    from peft import LoraConfig, PeftConfig, PeftModel
    from transformers import AutoModel

    service = trained["service"]
    base_dir = tmp_path / "base"
    service.backbone.save_pretrained(base_dir)
    export_directory(service.export_params("lora"), tmp_path / "export", base_model_path=str(base_dir))
    adapter_dir = tmp_path / "export" / ADAPTER_DIR
    config = PeftConfig.from_pretrained(str(adapter_dir))
    assert isinstance(config, LoraConfig)
    assert (config.r, config.lora_alpha, sorted(config.target_modules)) == (4, 8.0, LORA["target_modules"])
    assert config.base_model_name_or_path == str(base_dir)

    # Stock transformers + peft: the base model's text model with the exported adapter.
    base = AutoModel.from_pretrained(str(base_dir)).eval()
    peft_text = PeftModel.from_pretrained(base.text_model, str(adapter_dir)).eval()
    tokenizer = service.backbone.tokenizer
    ids = tokenizer(TEXTS[:2], padding=True, return_tensors="pt")
    with torch.no_grad():
        theirs = peft_text(input_ids=ids["input_ids"], attention_mask=ids["attention_mask"]).last_hidden_state
        with service.backbone.adapters.routing(["lora"] * 2):
            ours = service.backbone.text_model(
                input_ids=ids["input_ids"], attention_mask=ids["attention_mask"]
            ).last_hidden_state
        plain = service.backbone.text_model(input_ids=ids["input_ids"], attention_mask=ids["attention_mask"])
    real = ids["attention_mask"].bool()
    assert torch.allclose(theirs[real], ours[real], rtol=0, atol=1e-5)
    assert not torch.allclose(theirs[real], plain.last_hidden_state[real], atol=1e-3)  # the adapter acts

    # The whole vision-language forward: our encode through the stock-loaded model equals ours.
    stock = ResidentBackbone.from_pretrained(base_dir)
    PeftModel.from_pretrained(stock.text_model, str(adapter_dir))  # injects in place, adapter active
    cfg = trained["configs"]["lora"]
    data = _batch(cfg, 3, 21)
    images = [[torch.as_tensor(c) for c in sample] for sample in data["images"]]
    expected = service.backbone.encode(images, data["task"], ["lora"] * 3)
    got = stock.encode(images, data["task"])
    assert torch.allclose(got.tokens, expected.tokens, rtol=0, atol=1e-5)
    assert torch.allclose(got.pooled, expected.pooled, rtol=0, atol=1e-5)
