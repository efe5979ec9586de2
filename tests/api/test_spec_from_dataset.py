"""Issue 41.13: `joynexus spec from-dataset DIR` writes the spec a LeRobot dataset needs (its
cameras, image size, state and action dims, task), which creates a tenant the dataset trains and
uploads into as it is; a dataset that cannot back one tenant is refused in one line, exit 2."""

from __future__ import annotations

from pathlib import Path

import yaml
from typer.testing import CliRunner

from joynexus.cli import app
from tests.api.test_datasets import _tar
from tests.helpers import sft_spec, write_dataset_for


def test_the_spec_written_from_a_dataset_creates_a_tenant_that_takes_the_dataset(api, tmp_path):
    source = sft_spec("from-ds", tmp_path / "lab" / "pick", cameras=("top", "wrist"), image_size=(24, 40),
                      state_dim=5, action_dim=3, action_chunk=2)  # fmt: skip
    write_dataset_for(source, episodes=2, length=6)
    root = Path(source["dataset"]["root"])
    out = tmp_path / "spec.yaml"
    done = CliRunner().invoke(app, ["spec", "from-dataset", str(root), "--tenant", "from-ds-1", "-o", str(out)])
    assert done.exit_code == 0, done.output
    spec = yaml.safe_load(out.read_text())
    assert spec["observation"] | {"instruction": None} == {
        "cameras": ["top", "wrist"], "image_size": [24, 40], "state_dim": 5, "action_dim": 3, "action_chunk": 4,
        "instruction": None,
    }  # fmt: skip
    assert spec["dataset"]["root"] == str(root.resolve())
    created = api.client.post("/v1/admin/tenants", json=spec, headers=api.admin)
    assert created.status_code == 201, created.text
    headers = {"Authorization": f"Bearer {created.json()['key']['api_key']}"}
    uploaded = api.client.post("/v1/datasets?repo_id=lab/pick", content=_tar(root), headers=headers)
    assert uploaded.status_code == 201, uploaded.text


def test_a_folder_that_is_not_a_dataset_is_one_line_and_exit_2(tmp_path):
    done = CliRunner().invoke(app, ["spec", "from-dataset", str(tmp_path)])
    assert done.exit_code == 2 and "meta/info.json" in done.output and "Traceback" not in done.output, done.output
