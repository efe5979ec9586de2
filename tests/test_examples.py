"""The example workload specs (examples/specs/): one per task, each parsed as the CLI and the client
read it and accepted by the tenant creator of a real in-process deployment (the SFT one with a
dataset made by examples/specs/write_dataset.py, in image and in video mode)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from joynexus.client import load_spec_file
from joynexus.spec import TaskType, parse_workload_spec

SPECS = Path(__file__).resolve().parents[1] / "examples" / "specs"
SPEC_FILES = sorted(SPECS.glob("*.yaml"))


def _write_dataset_module():
    spec = importlib.util.spec_from_file_location("example_write_dataset", SPECS / "write_dataset.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_one_example_spec_per_task() -> None:
    tasks = sorted(parse_workload_spec(path).task.value for path in SPEC_FILES)
    assert tasks == sorted(task.value for task in TaskType)


@pytest.mark.parametrize("path", SPEC_FILES, ids=[p.stem for p in SPEC_FILES])
def test_an_example_spec_parses(path: Path) -> None:
    spec = parse_workload_spec(path)
    assert spec.tenant == f"example-{path.stem}" and spec.task.value == path.stem
    # What `joynexus tenant create` sends is the same spec.
    assert parse_workload_spec(load_spec_file(path)) == spec


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory):
    from joynexus.master.deployment import Deployment
    from joynexus.settings import Settings

    dep = Deployment.in_process(Settings(data_dir=tmp_path_factory.mktemp("examples"), torch_threads=1))
    yield dep
    dep.shutdown()


@pytest.mark.parametrize("mode", ["image", "video"])
def test_the_sft_example_is_created_on_a_dataset_its_script_writes(deployment, tmp_path: Path, mode: str) -> None:
    data = load_spec_file(SPECS / "sft.yaml")
    data["tenant"] = f"example-sft-{mode}"
    data["dataset"]["root"] = str(tmp_path / "datasets" / "example-sft")
    spec = parse_workload_spec(data)
    root = _write_dataset_module().write_dataset_for(spec, video=mode == "video", episodes=2, length=8)
    assert root == tmp_path / "datasets" / "example-sft" and (root / "meta" / "info.json").is_file()
    tenant = deployment.creator.create(spec)  # validates the dataset against the spec
    assert tenant.tenant_id == data["tenant"] and tenant.spec == spec


@pytest.mark.parametrize("name", ["rl", "eval"])
def test_the_simulator_examples_are_created(deployment, name: str) -> None:
    # The creator opens a session of the simulator to check cameras, state and action dims.
    spec = parse_workload_spec(SPECS / f"{name}.yaml")
    tenant = deployment.creator.create(spec)
    assert tenant.tenant_id == f"example-{name}" and tenant.spec.task.value == name
