"""Datasets from the Python clients and the CLI (issue 24): upload a LeRobot folder or archive,
list, train on it by naming it in a workload spec, delete; the same from AsyncJoyNexusClient and
`joynexus dataset upload|list|delete`."""

from __future__ import annotations

import asyncio
import re
import zipfile
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.api.conftest import SHAPES
from tests.helpers import sft_spec, write_dataset_for


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """A LeRobot dataset of the "arm" interface, other content than the tenants' own."""
    spec = sft_spec("client-src", tmp_path_factory.mktemp("client-ds") / "arm-moves", **SHAPES["arm"])
    write_dataset_for(spec, episodes=2, length=5, seed=7)
    return Path(spec["dataset"]["root"])


def test_the_sync_client_uploads_trains_on_and_deletes_a_dataset(api, live_server, folder, tmp_path):
    from joynexus.client import ApiRequestError, InvalidArgument, JoyNexusClient

    tenant = api.tenant("client-ds")
    with JoyNexusClient(live_server, tenant.api_key) as client:
        info = client.upload_dataset(folder)  # a folder: packed by the client
        assert info.repo_id == "local/arm-moves" and info.bytes > 0 and len(info.dataset_id) == 64
        archive = tmp_path / "moves.zip"
        with zipfile.ZipFile(archive, "w") as zipped:
            for file in sorted(p for p in folder.rglob("*") if p.is_file()):
                zipped.write(file, file.relative_to(folder).as_posix())
        zipped_info = client.upload_dataset(archive, repo_id="team/moves")  # an archive: sent as it is
        assert zipped_info.repo_id == "team/moves"
        assert {d.dataset_id for d in client.datasets()} == {info.dataset_id, zipped_info.dataset_id}
        assert client.usage().dataset_bytes == info.bytes + zipped_info.bytes

        spec = {**tenant.spec, "dataset": {"id": info.dataset_id, "repo_id": info.repo_id}}
        final = client.submit(spec, jobs=1).result(timeout=90)
        assert final.state == "completed" and final.dataset_id == info.dataset_id
        assert client.checkpoint_manifest(final.version).extra["dataset_sha256"] == info.dataset_id

        deleted = client.delete_dataset(zipped_info.dataset_id)
        assert deleted.deleted and deleted.bytes == zipped_info.bytes
        assert client.usage().dataset_bytes == info.bytes
        with pytest.raises(ApiRequestError) as missing:
            client.delete_dataset(zipped_info.dataset_id)
        assert missing.value.status_code == 404 and missing.value.problems[0].field == "dataset_id"
        with pytest.raises(InvalidArgument) as refused:  # checked here, nothing sent
            client.upload_dataset(tmp_path / "nothing-here")
        assert refused.value.problems[0].field == "path"


def test_the_async_client_uploads_lists_and_deletes(api, live_server, folder):
    from joynexus.client import AsyncJoyNexusClient

    tenant = api.tenant("client-ds-async")

    async def scenario():
        async with AsyncJoyNexusClient(live_server, tenant.api_key) as client:
            info = await client.upload_dataset(folder, repo_id="team/async")
            listed = await client.datasets()
            deleted = await client.delete_dataset(info.dataset_id)
            return info, listed, deleted, await client.datasets()

    info, listed, deleted, after = asyncio.run(scenario())
    assert [d.dataset_id for d in listed] == [info.dataset_id] and listed[0].repo_id == "team/async"
    assert deleted.dataset_id == info.dataset_id and after == []


def test_the_cli_uploads_lists_and_deletes_datasets(api, live_server, folder):
    from joynexus.cli import app

    tenant = api.tenant("client-ds-cli")
    runner = CliRunner()
    env = {"JOYNEXUS_URL": live_server, "JOYNEXUS_API_KEY": tenant.api_key, "COLUMNS": "200"}
    uploaded = runner.invoke(app, ["dataset", "upload", str(folder), "--repo-id", "team/cli"], env=env)
    assert uploaded.exit_code == 0, uploaded.output
    dataset_id = re.search(r"dataset ([0-9a-f]{64}) \(team/cli", uploaded.output).group(1)
    assert f"dataset: {{id: {dataset_id}, repo_id: team/cli}}" in uploaded.output
    listed = runner.invoke(app, ["dataset", "list"], env=env)
    assert listed.exit_code == 0 and dataset_id in listed.output and "team/cli" in listed.output
    usage = runner.invoke(app, ["usage"], env=env)
    assert usage.exit_code == 0 and "datasets" in usage.output
    deleted = runner.invoke(app, ["dataset", "delete", dataset_id, "--yes"], env=env)
    assert deleted.exit_code == 0 and f"deleted dataset {dataset_id}" in deleted.output, deleted.output
    again = runner.invoke(app, ["dataset", "delete", dataset_id, "--yes"], env=env)
    assert again.exit_code == 1 and "404 not_found" in again.output and "dataset_id" in again.output
    bad = runner.invoke(app, ["dataset", "upload", str(folder / "meta" / "info.json")], env=env)
    assert bad.exit_code == 2 and "path" in bad.output
