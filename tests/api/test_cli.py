"""The `joynexus` commands of the tenant API against a real server: tenant create, workload submit
--watch, versions, export, usage."""

from __future__ import annotations

import re

import pytest
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
    bundle = tmp_path / "bundle"
    exported = runner.invoke(app, ["export", "--version", "1", "-o", str(out), "--dir", str(bundle)], env=env)
    assert exported.exit_code == 0, exported.output
    assert {p.name for p in (bundle / "action_module").iterdir()} >= {"config.json", "model.safetensors"}
    again = runner.invoke(app, ["export", "--version", "1", "-o", str(out), "--dir", str(bundle)], env=env)
    assert again.exit_code == 2 and "--dir" in again.output

    usage = runner.invoke(app, ["usage"], env=env)
    assert usage.exit_code == 0 and spec["tenant"] in usage.output
    everyone = runner.invoke(app, ["usage", "--all"], env=env)
    assert everyone.exit_code == 0 and spec["tenant"] in everyone.output

    capped = runner.invoke(app, ["tenant", "quota", spec["tenant"], "--max-device-seconds", "0"], env=env)
    assert capped.exit_code == 0, capped.output
    refused = runner.invoke(app, ["workload", "submit", "--jobs", "1"], env=env)
    assert refused.exit_code == 1 and "429 quota_exceeded" in refused.output
    # the refusal is said once, with the quota it hit
    assert refused.output.count("no new work is admitted") == 1, refused.output


def test_cli_says_which_key_is_missing(live_server):
    result = CliRunner().invoke(app, ["versions"], env={"JOYNEXUS_URL": live_server, "JOYNEXUS_API_KEY": ""})
    assert result.exit_code == 2 and "no api key" in result.output
    bad = CliRunner().invoke(app, ["usage"], env={"JOYNEXUS_URL": live_server, "JOYNEXUS_API_KEY": "nope"})
    assert bad.exit_code == 1 and "401 unauthenticated" in bad.output


def _create(tmp_path, live_server, spec: dict | str, name: str = "spec.yaml"):
    spec_file = tmp_path / name
    spec_file.write_text(spec if isinstance(spec, str) else yaml.safe_dump(spec))
    env = {"JOYNEXUS_URL": live_server, "JOYNEXUS_ADMIN_KEY": ADMIN_KEY}
    return CliRunner().invoke(app, ["tenant", "create", str(spec_file)], env=env), spec_file


def test_a_refused_spec_prints_every_problem_with_its_field(api, live_server, tmp_path):
    spec = api.spec("cli-refused")
    spec["observation"].update(state_dim=5, action_dim=2)  # the dataset has 4 and 3
    spec["observation"]["cameras"] = ["front", "top"]  # the dataset has no "top"
    result, _ = _create(tmp_path, live_server, spec)
    assert result.exit_code == 1, result.output
    lines = result.output.splitlines()
    assert lines[0] == "422 invalid_spec: invalid workload spec"
    problems = {line.strip().split(": ", 1)[0] for line in lines[1:]}
    assert {"dataset.cameras", "dataset.state_dim", "dataset.action_dim"} <= problems, result.output
    assert any("'top'" in line for line in lines)  # reasons printed as they are (not as rich markup)


def test_a_spec_refused_by_its_schema_prints_every_field(api, live_server, tmp_path):
    spec = api.spec("cli-schema")
    spec["tenant"] = "Not A Tenant Id"
    spec["training"]["learning_rate"] = -1
    result, _ = _create(tmp_path, live_server, spec)
    assert result.exit_code == 1, result.output
    assert result.output.startswith("422 invalid_input: ")
    assert "\n  tenant: " in result.output and "\n  training.learning_rate: " in result.output


@pytest.mark.parametrize(
    ("name", "text", "where"),
    [
        ("bad.yaml", "tenant: a\nobservation:\n  cameras: [front\n  state_dim: 4\n", ":4:12: YAML syntax error: "),
        ("bad.json", '{"tenant": "a",\n "task": sft}\n', ":2:10: JSON syntax error: Expecting value"),
    ],
    ids=["yaml", "json"],
)
def test_a_spec_file_that_does_not_parse_is_one_line_with_its_place(live_server, tmp_path, name, text, where):
    result, spec_file = _create(tmp_path, live_server, text, name)
    assert result.exit_code == 2, result.output
    assert result.output.count("\n") == 1 and "Traceback" not in result.output
    assert result.output.startswith(f"error: {spec_file}{where}"), result.output


def test_a_spec_file_without_a_mapping_is_refused(live_server, tmp_path):
    result, spec_file = _create(tmp_path, live_server, "- just\n- a list\n")
    assert result.exit_code == 2 and result.output.count("\n") == 1
    assert result.output.startswith(f"error: {spec_file}: holds a list, not a mapping")


def test_an_unreachable_server_is_one_line(tmp_path):
    from tests.api.conftest import free_port

    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    result = CliRunner().invoke(app, ["usage"], env={"JOYNEXUS_URL": url, "JOYNEXUS_API_KEY": "k"})
    assert result.exit_code == 1 and result.output.count("\n") == 1, result.output
    assert result.output.startswith(f"connection_failed: no answer from {url} (ConnectError")


@pytest.mark.parametrize(
    ("command", "shown"),
    [
        (
            ["serve"],
            ["[default: 127.0.0.1]", "[default: 8765]", "[default: ray]", "[default: 64]", "[default: (./var)]"],
        ),
        (
            ["workload", "submit"],
            ["[default: (the spec's scheduling.completion_target)]", "[default: (http://127.0.0.1:8765)]"],
        ),
        (["workload", "eval"], ["[default: (the latest served)]", "[default: 4]"]),
        (["tenant", "create"], ["[default: issue-key]"]),
        (["tenant", "quota"], ["[default: (the server's default)]"]),
        (["versions"], ["[default: (all)]"]),
        (["export"], ["[default: (the current training parameters)]", "[default: (<tenant>-v<N>.safetensors)]"]),
        (["up"], ["[default: ($JOYNEXUS_DATA_DIR or ./var)]", "[default: 300.0]"]),
    ],
    ids=lambda value: "-".join(value) if isinstance(value[0], str) and not value[0].startswith("[") else "",
)
def test_help_shows_the_defaults(command, shown):
    result = CliRunner().invoke(app, [*command, "--help"], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    for text in shown:
        assert text in result.output, (text, result.output)
