"""Builders shared by tests: tenant specs and datasets that match them."""

from __future__ import annotations

import gc
import io
import tarfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

TINY_MODEL_ID = "joynexus/tiny-smolvlm"


def sft_spec(
    tenant: str,
    dataset_root: Path | str,
    *,
    base_model: str = TINY_MODEL_ID,
    cameras: tuple[str, ...] = ("front",),
    image_size: tuple[int, int] = (32, 32),
    state_dim: int = 4,
    action_dim: int = 3,
    action_chunk: int = 2,
    module: str = "oft_mlp",
    jobs: int | None = 4,
    samples_per_job: int = 16,
    microbatch_size: int = 8,
    lr: float = 3e-3,
    max_in_flight: int = 2,
) -> dict[str, Any]:
    return {
        "tenant": tenant,
        "base_model": base_model,
        "task": "sft",
        "action_module": {"kind": module, "size": "tiny"},
        "observation": {
            "cameras": list(cameras),
            "image_size": list(image_size),
            "state_dim": state_dim,
            "action_dim": action_dim,
            "action_chunk": action_chunk,
            "instruction": "pick up the cube",
        },
        "dataset": {"root": str(dataset_root), "repo_id": f"test/{tenant}"},
        "scheduling": {"max_in_flight_jobs": max_in_flight, "completion_target": jobs},
        "training": {"samples_per_job": samples_per_job, "microbatch_size": microbatch_size, "learning_rate": lr},
    }


def write_dataset_for(spec: dict[str, Any], *, episodes: int = 3, length: int = 20, seed: int = 0) -> Path:
    from joynexus.data.lerobot_dataset import write_synthetic_dataset

    obs = spec["observation"]
    return write_synthetic_dataset(
        spec["dataset"]["root"],
        spec["dataset"]["repo_id"],
        cameras=obs["cameras"],
        image_size=tuple(obs["image_size"]),
        state_dim=obs["state_dim"],
        action_dim=obs["action_dim"],
        num_episodes=episodes,
        episode_length=length,
        task=obs["instruction"],
        seed=seed,
    )


def compiled_config(tenant: str, capabilities: Any, **shape: Any) -> Any:
    """A TenantBackendConfig compiled by the real spec compiler, without a dataset or a store."""
    from joynexus.core.tenants import BackendCapabilities
    from joynexus.master.tenant_creator import SpecCompiler
    from joynexus.spec import parse_workload_spec

    spec = sft_spec(tenant, "/unused", base_model=capabilities.model_id, **shape)
    spec["task"] = "eval"  # evaluation tenants need no dataset: compile checks only the interface
    spec["dataset"] = None
    return SpecCompiler(BackendCapabilities.single(capabilities)).compile(parse_workload_spec(spec))


@contextmanager
def session_heap_frozen() -> Iterator[None]:
    """Out of the cycle collector while a latency is measured: what this pytest process holds now.

    A served process freezes its startup heap once (`joynexus.core.heap`), so its full collections
    walk only what it made since. An in-process test server shares the pytest process with every
    object earlier tests left alive (~0.7M tracked after tests/api alone, more late in a full run):
    full collections over them took 0.2-0.7 s each here, several per flood, and a latency bound
    measured the test session's heap instead of the server's. Unfrozen again afterwards."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def wait_for(predicate: Callable[[], Any], what: str, timeout_s: float = 60.0, poll_s: float = 0.05) -> Any:
    """Poll `predicate` until it returns something truthy (returned); fail naming `what` after the timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(poll_s)


def random_microbatch(
    config: Any, rows: int, seed: int, texts: tuple[str, ...] = ("pick up the cube",)
) -> dict[str, Any]:
    """A `train_batch` microbatch of random data in a compiled tenant config's shapes, annotated
    with its tenant and schema; sample i's instruction is texts[(seed + i) % len(texts)]."""
    rng = np.random.default_rng(seed)
    h, w = config.image_size
    return {
        "images": rng.random((rows, len(config.cameras), 3, h, w), dtype=np.float32),
        "state": rng.standard_normal((rows, config.state_dim)).astype(np.float32),
        "action": rng.uniform(-1, 1, (rows, config.action_chunk, config.action_dim)).astype(np.float32),
        "action_is_pad": np.zeros((rows, config.action_chunk), dtype=bool),
        "task": [texts[(seed + i) % len(texts)] for i in range(rows)],
        "tenant_id": [config.tenant_id] * rows,
        "schema_signature": [config.schema_signature] * rows,
    }


def assert_state_equal(a: Any, b: Any, where: str = "") -> None:
    """Bit-identical nested state (tenant_state() values): tensors by dtype, shape and torch.equal;
    lists and tuples by type and length; everything else by ==."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for key in a:
            assert_state_equal(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_state_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def assert_state_close(a: Any, b: Any, atol: float, where: str = "") -> None:
    """Recursive comparison of tenant_state() values; atol=0 means bit-identical."""
    if isinstance(a, torch.Tensor):
        assert a.shape == b.shape and a.dtype == b.dtype, where
        assert torch.allclose(a, b, rtol=0, atol=atol), f"{where}: max |diff| {(a - b).abs().max().item():.3g}"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_state_close(a[key], b[key], atol, f"{where}/{key}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_state_close(x, y, atol, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


# Gradients at this RMS or below are rounding noise (e.g. attention key biases: softmax ignores a
# shift shared by all keys, so their exact gradient is 0 and what is computed is ~1e-11).
ROUNDING_LEVEL_GRADIENT = 1e-9


def assert_trained_state_close(
    want: dict[str, Any], got: dict[str, Any], lr: float, steps: int, atol: float = 5e-5, where: str = ""
) -> None:
    """tenant_state() of one tenant trained `steps` AdamW steps on the same data by two code paths
    (kernels that round differently). AdamW divides each update by the gradient's own running RMS,
    so an element whose gradient is rounding noise takes +-lr steps in a direction rounding picks:
    those elements (RMS from the optimizer's exp_avg_sq, in both states) may differ by up to
    2 * lr * steps; every other element within `atol`, except at most 1 in 1,000 of a tensor
    (within 2 * lr * steps too): an element whose gradient at ONE step was at the rounding level
    (it cancels) takes that step at a size rounding picks (AdamW's first steps are ~lr whatever the
    gradient's size), and exp_avg_sq keeps only its larger gradients, so such an element cannot be
    told afterwards. A wrong split or a missed all-reduce moves most elements, not one in 1,000.
    Module tensors must be the parameters, in
    the optimizer's order (no buffers). A LoRA adapter's tensors (after the module's in the
    optimizer): within `atol`."""
    assert want.keys() == got.keys(), where
    if "adapter" in want:
        assert_state_close(want["adapter"], got["adapter"], atol, f"{where}/adapter")
    module_want, module_got = want["module"], got["module"]
    assert module_want.keys() == module_got.keys(), where
    states_want, states_got = want["optimizer"]["state"], got["optimizer"]["state"]
    assert states_want.keys() == states_got.keys(), where  # keyed by parameter index; none before a gradient
    for index, key in enumerate(module_want):
        a, b = module_want[key], module_got[key]
        assert a.shape == b.shape and a.dtype == b.dtype, f"{where}/{key}"
        bound = torch.full_like(a, atol)
        if index in states_want:
            rms = torch.maximum(states_want[index]["exp_avg_sq"], states_got[index]["exp_avg_sq"]).sqrt()
            bound = torch.where(rms <= ROUNDING_LEVEL_GRADIENT, torch.full_like(a, 2 * lr * steps), bound)
        diff = (a - b).abs()
        over = diff > bound
        assert int(over.sum()) <= a.numel() // 1000 and bool((diff <= 2 * lr * steps).all()), (
            f"{where}/{key}: max |diff| {diff.max().item():.3g} "
            f"({int(over.sum())} of {a.numel()} elements over their bound"
            + (f"; their gradient RMS {rms[over].tolist()[:8]}" if index in states_want else "")
            + ")"
        )


def interface_config(name: str, caps: Any, kind: str, seed: int, adapter: dict[str, Any] | None = None) -> Any:
    """A tenant compiled by the real spec compiler for the tiny backbone's capabilities `caps`,
    interface only (no dataset), then typed as an SFT tenant with `seed`; `adapter`: a LoRA spec."""
    from joynexus.core.tenants import BackendCapabilities
    from joynexus.master.tenant_creator import SpecCompiler
    from joynexus.spec import parse_workload_spec

    spec = sft_spec(name, "/unused", base_model=TINY_MODEL_ID, module=kind)
    spec.update(task="eval", dataset=None)  # compile the interface only
    if adapter is not None:
        spec["adapter"] = adapter
    config = SpecCompiler(BackendCapabilities.single(caps)).compile(parse_workload_spec(spec))
    return config.model_copy(update={"task_type": "sft", "seed": seed})


def padded_microbatch(
    name: str, schema: dict[str, Any], cfg: Any, rows: int, rng: np.random.Generator
) -> dict[str, Any]:
    """A microbatch of random data in an observation `schema`'s shapes, drawn from a shared `rng`,
    whose first sample's last chunk step is padding (excluded from the loss in every path)."""
    h, w = schema["image_size"]
    chunk, dim = schema["action_chunk"], schema["action_dim"]
    pad = np.zeros((rows, chunk), dtype=bool)
    pad[0, -1] = True
    return {
        "images": rng.random((rows, len(schema["cameras"]), 3, h, w), dtype=np.float32),
        "state": rng.standard_normal((rows, schema["state_dim"])).astype(np.float32),
        "action": rng.standard_normal((rows, chunk, dim)).astype(np.float32),
        "action_is_pad": pad,
        "task": [f"task {i % 3}" * (1 + i % 2) for i in range(rows)],
        "tenant_id": [name] * rows,
        "schema_signature": [cfg.schema_signature] * rows,
    }


def tar_dataset(root: Path, *, gz: bool = True, extra: dict[str, bytes] | None = None) -> bytes:
    """A dataset folder as an upload archive (its folder as the one top-level entry); plain tar
    (``gz=False``) is byte-stable, gzip stamps a time. ``extra``: more members, name -> bytes."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz" if gz else "w") as tar:
        tar.add(root, arcname=root.name)
        for name, data in (extra or {}).items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


@contextmanager
def ray_deployment(settings: Any, *, num_cpus: int | None = None) -> Iterator[Any]:
    """The Ray deployment `settings` name (`connect(mode="ray")`), torn down after: the cluster
    closed, its namespace's service actors removed, and Ray shut down if this call started it
    (a local Ray of `num_cpus` logical CPUs when given)."""
    import ray

    from joynexus.actors import init_ray
    from joynexus.connect import connect
    from joynexus.ops.supervisor import remove_service_actors

    started_ray = not ray.is_initialized()
    cluster = None
    try:
        if started_ray and num_cpus is not None:
            init_ray(num_cpus=num_cpus)
        cluster = connect(settings, mode="ray")
        yield cluster
    finally:
        if cluster is not None:
            cluster.close()
        if ray.is_initialized():
            remove_service_actors(settings.ray_namespace)
            if started_ray:
                ray.shutdown()
