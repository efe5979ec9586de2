"""Shared fixtures: control-plane stores on SQLite and on the PostgreSQL server of this machine."""

from __future__ import annotations

import os
import uuid

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

POSTGRES_ADMIN_URL = os.environ.get("JOYNEXUS_TEST_POSTGRES", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")


def _postgres_database() -> tuple[str, str] | None:
    """Create a throwaway database; None if the server is not reachable."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.exc import OperationalError

    name = f"joynexus_test_{uuid.uuid4().hex[:12]}"
    admin = create_engine(POSTGRES_ADMIN_URL, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
    except OperationalError:
        return None
    finally:
        admin.dispose()
    return name, POSTGRES_ADMIN_URL.rsplit("/", 1)[0] + f"/{name}"


def _drop_postgres_database(name: str) -> None:
    from sqlalchemy import create_engine, text

    admin = create_engine(POSTGRES_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def store_url(request, tmp_path):
    """A fresh, empty control-plane database URL on each backend."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'control.db'}"
        return
    created = _postgres_database()
    if created is None:
        pytest.skip("PostgreSQL at 127.0.0.1:5432 is not reachable")
    name, url = created
    yield url
    _drop_postgres_database(name)


@pytest.fixture
def store(store_url):
    from joynexus.core.store import ControlPlaneStore

    s = ControlPlaneStore(store_url)
    yield s
    s.dispose()
