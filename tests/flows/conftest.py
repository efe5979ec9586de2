"""A Prefect API for the flow tests: `prefect_test_harness` (a temporary SQLite database and a
server subprocess, ~10 s to start, stopped at the end of the session), with task results in tmp."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def prefect_api(tmp_path_factory):
    from prefect.settings import PREFECT_LOCAL_STORAGE_PATH, temporary_settings
    from prefect.testing.utilities import prefect_test_harness

    with temporary_settings(updates={PREFECT_LOCAL_STORAGE_PATH: tmp_path_factory.mktemp("prefect-results")}):
        with prefect_test_harness(server_startup_timeout=120):
            yield
