"""The `joynexus` commands of the tenant API against a real server: tenant create, workload submit
--watch, versions, export, usage."""

from __future__ import annotations

import re

import yaml
from typer.testing import CliRunner

from joynexus.artifacts import decode_tenant_payload
from joynexus.cli import app
from tests.api.conftest import ADMIN_KEY


def test_cli_from_tenant_creation_to_export(api, live_server, tmp_path):
    runner = CliRunner()
    env = {"JOYNEXUS_URL": live_server, "JOYNEXUS_ADMIN_KEY": ADMIN_KEY, "COLUMNS": "200"}
    spec = api.spec("cli")
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(yaml.safe_dump(spec))

    created = runner.invoke(app, ["tenant", "create", str(spec_file)], env=env)
    assert created.exit_code == 0, created.output
    key = re.search(r"(jnx_[0-9a-f]{16}_[A-Za-z0-9_-]{43})", created.output).group(1)
    env["JOYNEXUS_API_KEY"] = key

    submitted = runner.invoke(app, ["workload", "submit", "--jobs", "1", "--watch"], env=env)
    assert submitted.exit_code == 0, submitted.output
    assert "completed" in submitted.output and "v1" in submitted.output

    listed = runner.invoke(app, ["workload", "list"], env=env)
    assert listed.exit_code == 0 and "completed" in listed.output and "1/1" in listed.output
    versions = runner.invoke(app, ["versions"], env=env)
    assert versions.exit_code == 0 and "training version 1" in versions.output

    out = tmp_path / "policy.safetensors"
    exported = runner.invoke(app, ["export", "--version", "1", "-o", str(out)], env=env)
    assert exported.exit_code == 0, exported.output
    assert decode_tenant_payload(out.read_bytes())[1].tenant_id == spec["tenant"]

    usage = runner.invoke(app, ["usage"], env=env)
    assert usage.exit_code == 0 and spec["tenant"] in usage.output
    everyone = runner.invoke(app, ["usage", "--all"], env=env)
    assert everyone.exit_code == 0 and spec["tenant"] in everyone.output

    capped = runner.invoke(app, ["tenant", "quota", spec["tenant"], "--max-device-seconds", "0"], env=env)
    assert capped.exit_code == 0, capped.output
    refused = runner.invoke(app, ["workload", "submit", "--jobs", "1"], env=env)
    assert refused.exit_code == 1 and "429 quota_exceeded" in refused.output


def test_cli_says_which_key_is_missing(live_server):
    result = CliRunner().invoke(app, ["versions"], env={"JOYNEXUS_URL": live_server, "JOYNEXUS_API_KEY": ""})
    assert result.exit_code == 2 and "no api key" in result.output
    bad = CliRunner().invoke(app, ["usage"], env={"JOYNEXUS_URL": live_server, "JOYNEXUS_API_KEY": "nope"})
    assert bad.exit_code == 1 and "401 unauthenticated" in bad.output
