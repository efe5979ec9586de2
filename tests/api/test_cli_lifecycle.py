"""Issue 26 on the command line: `joynexus delete-version` (allowed at the storage quota), and a
deleted tenant's retired id — `tenant create` refused naming why, `tenant purge` frees it."""

from __future__ import annotations

import yaml
from typer.testing import CliRunner

from joynexus.cli import app
from tests.api.conftest import ADMIN_KEY, wire


def test_cli_deletes_versions_and_purges_a_retired_tenant_id(api, live_server, tmp_path):
    t = api.tenant("cli-life")
    for seed in (1, 2):
        batch = wire(t.batch(2, seed=seed))
        assert api.client.post("/v1/train_batch", json=batch, headers=t.headers).status_code == 200
        assert api.client.post("/v1/save", json={}, headers=t.headers).status_code == 200
    runner = CliRunner()
    env = {"JOYNEXUS_URL": live_server, "JOYNEXUS_ADMIN_KEY": ADMIN_KEY, "JOYNEXUS_API_KEY": t.api_key,
           "COLUMNS": "200"}  # fmt: skip

    deleted = runner.invoke(app, ["delete-version", "1", "--yes"], env=env)
    assert deleted.exit_code == 0 and "deleted version 1: freed" in deleted.output, deleted.output
    latest = runner.invoke(app, ["delete-version", "2", "--yes"], env=env)
    assert latest.exit_code == 1 and "409 version_in_use" in latest.output and "LATEST" in latest.output

    assert runner.invoke(app, ["tenant", "delete", t.tenant_id, "--yes"], env=env).exit_code == 0
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(yaml.safe_dump(t.spec))
    refused = runner.invoke(app, ["tenant", "create", str(spec_file)], env=env)
    assert refused.exit_code == 1 and "409 conflict" in refused.output, refused.output
    assert f"tenant_id '{t.tenant_id}' cannot be reused" in refused.output and "tenant purge" in refused.output
    purged = runner.invoke(app, ["tenant", "purge", t.tenant_id, "--yes"], env=env)
    assert purged.exit_code == 0 and "purged" in purged.output, purged.output
    created = runner.invoke(app, ["tenant", "create", str(spec_file)], env=env)
    assert created.exit_code == 0, created.output
