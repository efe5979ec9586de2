"""Issue 41.10 and 41.11: a backbone directory no family serves is one line naming its model_type
and the families that exist, exit 2 (not a 93-line traceback from inside the Training Model
Service), from `joynexus serve` and `joynexus up`; a plain checkpoint directory without a model
name is served under the directory's own name, not this server's absolute path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from joynexus.ops.backbone_check import backbone_directory_problem
from joynexus.services.configs import backbone_source, directory_model_id
from joynexus.settings import Settings
from tests.hf_checkpoint import HF_MODEL_ID, write_plain_hf_checkpoint

ROOT = Path(__file__).resolve().parents[2]


def qwen2_directory(tmp_path: Path) -> Path:
    root = tmp_path / "Qwen2-VL-2B-Instruct"
    root.mkdir()
    (root / "config.json").write_text(json.dumps({"model_type": "qwen2_vl", "architectures": ["Qwen2VLForX"]}))
    return root


def test_an_unsupported_model_type_is_one_line_naming_it_and_the_families(tmp_path):
    problem = backbone_directory_problem(Settings(data_dir=tmp_path, backbone_path=str(qwen2_directory(tmp_path))))
    assert problem is not None and "\n" not in problem
    assert "model_type 'qwen2_vl'" in problem and "JOYNEXUS_BACKBONE_PATH" in problem
    assert "idefics3 (model_type idefics3, smolvlm)" in problem and "qwen_vl (model_type qwen3_vl)" in problem
    smolvlm = tmp_path / "smol"
    smolvlm.mkdir()
    (smolvlm / "config.json").write_text(json.dumps({"model_type": "smolvlm"}))
    assert backbone_directory_problem(Settings(data_dir=tmp_path, backbone_path=str(smolvlm))) is None
    assert backbone_directory_problem(Settings(data_dir=tmp_path)) is None  # a preset


@pytest.mark.parametrize("command", [["serve", "--services", "in-process", "--port", "0"], ["up"]])
def test_serve_and_up_exit_2_with_that_line_before_starting_anything(tmp_path, command):
    env = {**os.environ, "JOYNEXUS_DATA_DIR": str(tmp_path / "var"), "PYTHONPATH": str(ROOT),
           "JOYNEXUS_BACKBONE_PATH": str(qwen2_directory(tmp_path))}  # fmt: skip
    env.pop("JOYNEXUS_RAY_ADDRESS", None)
    program = "from joynexus.cli import app; app()"
    argv = [sys.executable, "-c", program, *command]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 2, done.stdout + done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "model_type 'qwen2_vl'" in lines[0], done.stderr
    assert "Traceback" not in done.stdout + done.stderr


def test_a_directory_without_a_model_name_is_served_under_its_own_name(tmp_path):
    unnamed = write_plain_hf_checkpoint(tmp_path / "SmolVLM-mine", name_or_path=None)
    named = write_plain_hf_checkpoint(tmp_path / "named", name_or_path=HF_MODEL_ID)
    assert directory_model_id(unnamed) == "SmolVLM-mine" and directory_model_id(named) is None
    backbone = backbone_source(Settings(data_dir=tmp_path, backbone_path=str(unnamed))).build()
    assert backbone.model_id == "SmolVLM-mine"
    declared = Settings(data_dir=tmp_path, backbone_path=str(unnamed), backbone_id="lab/smol-v2")
    assert backbone_source(declared).model_id == "lab/smol-v2"  # a declared id wins
    assert backbone_source(Settings(data_dir=tmp_path, backbone_path=str(named))).build().model_id == HF_MODEL_ID
