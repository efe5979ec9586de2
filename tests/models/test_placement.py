"""Device placement (issue 12.1): the placement is validated naming the field and the value; a
service on the CPU placement (and on a GPU, where this machine has one) trains and serves; a
bfloat16 backbone encodes and its tenants train in float32; checkpoints move between placements
(float32 <-> bfloat16 backbone, cuda <-> cpu) and everything that leaves a service is on the CPU."""

from __future__ import annotations

import json
import struct
from typing import Any

import numpy as np
import pydantic
import pytest
import torch

from joynexus.artifacts import ACTION_MODULE_FILE, decode_tenant_payload
from joynexus.models.backbone import BackboneSource
from joynexus.models.placement import DevicePlacement, PlacementError, cpu_copy, tensor_devices
from joynexus.scheduling.inference_queue import Observation
from joynexus.services.inference.service import InferenceModelService
from joynexus.services.training.service import TrainingModelService
from joynexus.settings import Settings
from tests.helpers import compiled_config, random_microbatch

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="no CUDA device on this machine: the cuda <-> cpu paths need one")
SHAPE = dict(cameras=("front",), image_size=(32, 32), state_dim=4, action_dim=3, action_chunk=2)


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _service(tmp_path, placement: Any) -> TrainingModelService:
    return TrainingModelService(BackboneSource(preset="tiny"), tmp_path / "ckpt", placement=placement)


def _config(service: TrainingModelService, name: str, module: str = "oft_mlp") -> Any:
    config = compiled_config(name, service.capabilities(), module=module, **SHAPE)
    return config.model_copy(update={"task_type": "sft", "seed": 7})


def _batch(config: Any, rows: int = 4, seed: int = 0) -> dict[str, Any]:
    return random_microbatch(config, rows, seed)


def _observations(config: Any, rows: int = 3) -> list[Observation]:
    rng = np.random.default_rng(11)
    h, w = config.image_size
    return [
        Observation(images=(rng.random((3, h, w), dtype=np.float32),), state=rng.standard_normal(4).astype(np.float32))
        for _ in range(rows)
    ]


def _on_cpu(value: Any) -> bool:
    return all(device.type == "cpu" for device in tensor_devices(value))


# -- validation ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("fields", "field", "value"),
    [
        ({"device": "gpu"}, "device", "gpu"),
        ({"device": "cuda:-1"}, "device", "cuda:-1"),
        ({"dtype": "float16"}, "dtype", "float16"),
    ],
)
def test_a_bad_placement_is_refused_naming_the_field_and_value(fields, field, value):
    with pytest.raises(pydantic.ValidationError) as error:
        DevicePlacement(**fields)
    assert field in str(error.value) and value in str(error.value)


def test_a_cuda_device_this_process_does_not_have_is_refused_where_it_is_resolved():
    # Built anywhere (a driver may configure an actor placed on a GPU node); checked where it runs.
    missing = DevicePlacement(device=f"cuda:{torch.cuda.device_count()}")
    with pytest.raises(PlacementError, match=r"device: 'cuda:\d+'"):
        missing.resolve()
    if not CUDA:
        with pytest.raises(PlacementError, match=r"device: 'cuda' needs a CUDA device"):
            DevicePlacement(device="cuda").resolve()
        with pytest.raises(PlacementError, match="device: 'cuda'"):
            _service_without_cuda()


def _service_without_cuda() -> None:
    InferenceModelService(BackboneSource(preset="tiny"), placement="cuda", start_worker=False)


def test_auto_takes_a_gpu_when_there_is_one_else_the_cpu():
    assert DevicePlacement().resolve().type == ("cuda" if CUDA else "cpu")
    assert DevicePlacement(device="CPU ").resolve() == torch.device("cpu")  # normalized
    assert DevicePlacement.of("cpu") == DevicePlacement.of({"device": "cpu"}) == DevicePlacement(device="cpu")


def test_settings_read_the_placement_from_the_environment(monkeypatch):
    monkeypatch.setenv("JOYNEXUS_DEVICE", "cpu")
    monkeypatch.setenv("JOYNEXUS_DTYPE", "bfloat16")
    monkeypatch.setenv("JOYNEXUS_AUTOCAST", "0")
    assert DevicePlacement.from_settings(Settings()) == DevicePlacement(device="cpu", dtype="bfloat16", autocast=False)
    monkeypatch.setenv("JOYNEXUS_DEVICE", "tpu")
    with pytest.raises(pydantic.ValidationError, match="device") as error:
        Settings()
    assert "tpu" in str(error.value)


def test_a_service_built_without_a_placement_follows_the_environment(monkeypatch):
    # What benchmarks and embedded runs rely on: JOYNEXUS_DEVICE / JOYNEXUS_DTYPE reach every service.
    monkeypatch.setenv("JOYNEXUS_DEVICE", "cpu")
    monkeypatch.setenv("JOYNEXUS_DTYPE", "bfloat16")
    service = InferenceModelService(BackboneSource(preset="tiny"), start_worker=False)
    assert service.device == torch.device("cpu") and service.stats()["dtype"] == "bfloat16"
    assert {p.dtype for p in service.backbone.model.parameters()} == {torch.bfloat16}


# -- the CPU placement end to end ----------------------------------------------------------------
def test_the_cpu_placement_trains_serves_and_reports_its_device(tmp_path):
    training = _service(tmp_path, "cpu")
    config = _config(training, "cpu-tenant")
    training.add_tenant(config)
    losses = [training.train_batch("cpu-tenant", _batch(config, seed=s))["loss"] for s in range(3)]
    assert all(np.isfinite(losses))
    assert training.heartbeat()["device"] == training.backbone_info()["device"] == "cpu"
    assert training.backbone_info()["dtype"] == "float32"

    payload = training.export_params("cpu-tenant")
    tensors, _ = decode_tenant_payload(payload)
    assert _on_cpu(tensors) and _on_cpu(training.tenant_state("cpu-tenant"))
    inference = InferenceModelService(BackboneSource(preset="tiny"), placement={"device": "cpu"})
    try:
        inference.load_weights(payload)
        result = inference.predict("cpu-tenant", _observations(config))
        assert isinstance(result["actions"], np.ndarray) and result["actions"].shape == (3, 2, 3)
        assert inference.stats()["device"] == inference.heartbeat()["device"] == "cpu"
    finally:
        inference.close()


def test_tenant_state_is_a_copy_never_the_live_parameters(tmp_path):
    training = _service(tmp_path, "cpu")
    config = _config(training, "copy-tenant")
    training.add_tenant(config)
    training.train_batch("copy-tenant", _batch(config))
    state = training.tenant_state("copy-tenant")
    for tensor in state["module"].values():
        tensor.zero_()
    for value in (v for s in state["optimizer"]["state"].values() for v in s.values()):
        value.zero_()
    again = training.tenant_state("copy-tenant")
    assert any(bool(t.abs().sum() > 0) for t in again["module"].values())
    assert all(bool(s["exp_avg_sq"].abs().sum() > 0) for s in again["optimizer"]["state"].values())


# -- a bfloat16 backbone -------------------------------------------------------------------------
@pytest.mark.parametrize("preset", ["tiny", "qwen3-vl-tiny"])  # each backbone family
def test_a_bfloat16_backbone_encodes_close_to_float32_with_float32_features(preset):
    float32 = BackboneSource(preset=preset).build(placement=DevicePlacement(device="cpu"))
    bfloat16 = BackboneSource(preset=preset).build(placement=DevicePlacement(device="cpu", dtype="bfloat16"))
    assert {p.dtype for p in bfloat16.model.parameters()} == {torch.bfloat16}
    g = torch.Generator().manual_seed(0)
    images = [[torch.rand(3, 48, 64, generator=g)], [torch.rand(3, 32, 32, generator=g)] * 2, []]
    texts = ["pick up the red cube", "push the green block to the left side of the table", "open the drawer"]
    reference, features = float32.encode(images, texts), bfloat16.encode(images, texts)
    assert features.tokens.dtype == features.pooled.dtype == torch.float32  # tenant modules stay float32
    assert torch.equal(features.mask, reference.mask)
    # bfloat16 keeps ~3 significant digits: a few tenths of a percent per layer, not a different
    # answer (patch positions computed in bfloat16 used to shift, 18% off: see _cast_patch_inputs).
    error = (features.tokens - reference.tokens).norm() / reference.tokens.norm()
    assert error < 0.03, f"relative error of bfloat16 features {error:.3g}"
    # Samples stay independent of their batch in bfloat16 too: bit for bit on the Idefics3 decoder;
    # on Qwen3's, sdpa over a longer padded key range rounds differently (also ~5e-7 in float32).
    alone = bfloat16.encode(images[:1], texts[:1])
    length = int(alone.mask.sum())
    if preset == "tiny":
        assert torch.equal(alone.tokens[0, :length], features.tokens[0, :length])
    else:
        torch.testing.assert_close(alone.tokens[0, :length], features.tokens[0, :length], rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("preset", ["tiny", "qwen3-vl-tiny"])
def test_a_lora_adapter_on_a_bfloat16_backbone_is_float32_and_gets_gradients(preset):
    from joynexus.models.adapters import LoraAdapterConfig

    backbone = BackboneSource(preset=preset).build(placement=DevicePlacement(device="cpu", dtype="bfloat16"))
    backbone.adapters.add(
        "t", LoraAdapterConfig(rank=4, alpha=8, target_modules=("q_proj", "v_proj")), seed=1, trainable=True
    )
    params = backbone.adapters.parameters("t")
    assert {p.dtype for p in params} == {torch.float32}  # AdamW steps on float32 weights
    features = backbone.encode([[torch.rand(3, 32, 32)]] * 2, ["pick up the cube", "open"], ["t", None], grad=True)
    features.pooled.sum().backward()
    assert all(p.grad is not None and bool(torch.isfinite(p.grad).all()) for p in params)
    assert any(bool(p.grad.abs().sum() > 0) for p in params)


@pytest.mark.parametrize("module", ["oft_mlp", "flow_matching"])
def test_a_tenant_trains_on_a_bfloat16_backbone_in_float32(tmp_path, module):
    training = _service(tmp_path, DevicePlacement(device="cpu", dtype="bfloat16"))
    config = _config(training, "bf16-tenant", module)
    training.add_tenant(config)
    losses = [training.train_batch("bf16-tenant", _batch(config, seed=s))["loss"] for s in range(3)]
    assert all(np.isfinite(losses))
    state = training.tenant_state("bf16-tenant")
    assert {t.dtype for t in state["module"].values() if t.is_floating_point()} == {torch.float32}
    moments = [s["exp_avg"] for s in state["optimizer"]["state"].values()]
    assert moments and {t.dtype for t in moments} == {torch.float32}
    assert training.backbone_info()["dtype"] == "bfloat16"


# -- checkpoints and payloads across placements --------------------------------------------------
def _train_and_save(tmp_path, placement: Any, name: str) -> tuple[TrainingModelService, Any]:
    writer = _service(tmp_path, placement)
    config = _config(writer, name)
    writer.add_tenant(config)
    for seed in range(2):
        writer.train_batch(name, _batch(config, seed=seed))
    writer.save([name])
    return writer, config


def _resumes_bit_identical(tmp_path, written_on: Any, loaded_on: Any) -> None:
    writer, config = _train_and_save(tmp_path, written_on, "moving")
    reader = _service(tmp_path, loaded_on)  # same checkpoint root: a service restarted elsewhere
    assert reader.add_tenant(config)["resumed"]
    before, after = writer.tenant_state("moving"), reader.tenant_state("moving")
    assert before["version"] == after["version"]
    for key, tensor in before["module"].items():
        assert torch.equal(tensor, after["module"][key]), key
    for index, moments in before["optimizer"]["state"].items():
        for key, tensor in moments.items():
            assert torch.equal(tensor, after["optimizer"]["state"][index][key]), (index, key)
    # The restored slot lives on the reader's device and keeps training there.
    assert {p.device for p in reader._slot("moving").module.parameters()} == {reader.device}
    assert np.isfinite(reader.train_batch("moving", _batch(config, seed=5))["loss"])
    assert reader.export_params("moving")  # and exports from there


@pytest.mark.parametrize(
    ("written_on", "loaded_on"),
    [
        ({"device": "cpu"}, {"device": "cpu", "dtype": "bfloat16"}),
        ({"device": "cpu", "dtype": "bfloat16"}, {"device": "cpu"}),
    ],
    ids=["float32-to-bfloat16", "bfloat16-to-float32"],
)
def test_a_checkpoint_moves_between_backbone_dtypes(tmp_path, written_on, loaded_on):
    _resumes_bit_identical(tmp_path, written_on, loaded_on)


@needs_cuda
@pytest.mark.parametrize(
    ("written_on", "loaded_on"), [("cuda", "cpu"), ("cpu", "cuda")], ids=["cuda-to-cpu", "cpu-to-cuda"]
)
def test_a_checkpoint_moves_between_cuda_and_cpu(tmp_path, written_on, loaded_on):
    _resumes_bit_identical(tmp_path, written_on, loaded_on)


@needs_cuda
def test_a_cuda_service_trains_serves_and_hands_out_cpu_tensors(tmp_path):
    training = _service(tmp_path, "cuda")
    config = _config(training, "gpu-tenant", "flow_matching")
    training.add_tenant(config)
    assert np.isfinite(training.train_batch("gpu-tenant", _batch(config))["loss"])
    assert {p.device.type for p in training._slot("gpu-tenant").module.parameters()} == {"cuda"}
    assert _on_cpu(training.tenant_state("gpu-tenant"))
    payload = training.export_params("gpu-tenant")
    assert _on_cpu(decode_tenant_payload(payload)[0])
    inference = InferenceModelService(BackboneSource(preset="tiny"), placement="cuda")
    try:
        inference.load_weights(payload)
        result = inference.predict("gpu-tenant", _observations(config), seeds=[1, 2, 3])
        assert isinstance(result["actions"], np.ndarray) and np.isfinite(result["actions"]).all()
        assert inference.stats()["device"].startswith("cuda")
    finally:
        inference.close()


def test_a_checkpoint_records_no_device_and_loads_onto_the_device_asked_for(tmp_path):
    # What can be checked without an accelerator: the stored bytes name no device (safetensors
    # keeps dtype, shape and offsets), and map_location really moves the weights (to torch's
    # `meta` device here, the one non-CPU device every machine has).
    writer, _ = _train_and_save(tmp_path, "cpu", "anywhere")
    version = writer.policy_version("anywhere")
    data = writer.checkpoints.blobs.read(
        f"{writer.checkpoints._version_prefix('anywhere', version)}/{ACTION_MODULE_FILE}"
    )
    header = json.loads(data[8 : 8 + struct.unpack("<Q", data[:8])[0]])
    assert all(
        set(entry) == {"dtype", "shape", "data_offsets"} for key, entry in header.items() if key != "__metadata__"
    )
    assert "cuda" not in json.dumps(header) and "device" not in json.dumps(header)

    _, module_state, optimizer_state = writer.checkpoints.load_tenant("anywhere", map_location="meta")
    assert {t.device.type for t in module_state.values()} == {"meta"}
    assert _on_cpu(optimizer_state)  # Optimizer.load_state_dict places it by each parameter's device
    _, module_state, _ = writer.checkpoints.load_tenant("anywhere")
    assert _on_cpu(module_state)


def test_payloads_do_not_depend_on_the_backbone_dtype(tmp_path):
    # A tenant's module is float32 whatever the backbone: a fresh tenant exports the same tensors.
    payloads = []
    for dtype in ("float32", "bfloat16"):
        service = TrainingModelService(
            BackboneSource(preset="tiny"), tmp_path / dtype, placement={"device": "cpu", "dtype": dtype}
        )
        service.add_tenant(_config(service, "same"))
        payloads.append(decode_tenant_payload(service.export_params("same"))[0])
    assert payloads[0].keys() == payloads[1].keys()
    assert all(torch.equal(payloads[0][k], payloads[1][k]) for k in payloads[0])


def test_cpu_copy_copies_nested_state():
    live = torch.ones(2)
    copied = cpu_copy({"a": [live, (live,)], "n": 3})
    copied["a"][0].zero_()
    assert torch.equal(live, torch.ones(2)) and copied["n"] == 3 and isinstance(copied["a"][1], tuple)
