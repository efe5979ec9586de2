"""Issue 29 item 4: per-app PostgreSQL users made by the Job joynexus-db-users (joynexus/ops/db_users.py),
on this machine's PostgreSQL, as a master role like RDS's (LOGIN, CREATEROLE, CREATEDB, not superuser)
that owns the control plane's database. Each app's role: login only, owner of its own database, no
CONNECT to another app's; its password stored as a SCRAM verifier (checked here from RFC 5802);
objects the master made before pass to the app; a re-run after a rotation sets the new password."""

from __future__ import annotations

import base64
import hashlib
import hmac
import uuid

import pytest

from joynexus.ops import db_users

psycopg = pytest.importorskip("psycopg")
pytestmark = pytest.mark.postgres
ADMIN = {"host": "127.0.0.1", "port": 5432, "user": "postgres", "dbname": "postgres", "autocommit": True}


def admin():
    try:
        return psycopg.connect(**ADMIN, connect_timeout=3)
    except psycopg.OperationalError:
        pytest.skip("PostgreSQL at 127.0.0.1:5432 is not reachable")


def verifies(verifier: str, password: str) -> bool:
    """RFC 5802 / 7677: StoredKey = H(HMAC(SaltedPassword, 'Client Key')), ServerKey likewise."""
    method, rest = verifier.split("$", 1)
    iterations_salt, keys = rest.split("$")
    iterations, salt = iterations_salt.split(":")
    stored, server = (base64.b64decode(k) for k in keys.split(":"))
    salted = hashlib.pbkdf2_hmac("sha256", password.encode(), base64.b64decode(salt), int(iterations))
    client_key = hmac.new(salted, b"Client Key", hashlib.sha256).digest()
    server_key = hmac.new(salted, b"Server Key", hashlib.sha256).digest()
    return method == "SCRAM-SHA-256" and hashlib.sha256(client_key).digest() == stored and server_key == server


@pytest.fixture
def deployment(tmp_path):
    tag = uuid.uuid4().hex[:8]
    master = f"jnx_master_{tag}"
    apps = {
        "control-plane": (f"jnx_app_{tag}", f"jnx_cp_{tag}"),
        "mlflow": (f"jnx_mlflow_{tag}", f"jnx_mlflow_{tag}"),
        "prefect": (f"jnx_prefect_{tag}", f"jnx_prefect_{tag}"),
    }
    with admin() as conn:
        conn.execute(f'CREATE ROLE "{master}" LOGIN CREATEROLE CREATEDB')
        conn.execute(f'CREATE DATABASE "{apps["control-plane"][1]}" OWNER "{master}"')  # RDS's db_name
    with psycopg.connect(**{**ADMIN, "user": master, "dbname": apps["control-plane"][1]}) as conn:
        conn.execute("CREATE TABLE tenants (id text primary key)")  # made before per-app users
    folder = tmp_path / "db"
    write(folder / "master", username=master, password="master-rotated-by-rds")
    for name, (user, database) in apps.items():
        write(folder / name, username=user, password=f"pw-{name}-{tag}", dbname=database, host="127.0.0.1", port="5432")
    yield folder, master, apps
    with admin() as conn:
        for _user, database in apps.values():
            conn.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
        for user, _ in apps.values():
            conn.execute(f'DROP ROLE IF EXISTS "{user}"')
        conn.execute(f'DROP ROLE IF EXISTS "{master}"')


def write(folder, **keys) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for key, value in keys.items():
        (folder / key).write_text(value)


def test_each_app_gets_its_own_least_privileged_user_and_database(deployment):
    folder, master, apps = deployment
    lines = db_users.run(folder, sslmode="prefer")
    assert len(lines) == 3 and "1 objects taken over" in lines[0]
    with admin() as conn:
        for name, (user, database) in apps.items():
            row = conn.execute(
                "SELECT rolsuper, rolcreatedb, rolcreaterole, rolreplication, rolcanlogin, rolpassword "
                "FROM pg_authid WHERE rolname = %s",
                (user,),
            ).fetchone()
            assert row[:5] == (False, False, False, False, True), name
            assert verifies(row[5], (folder / name / "password").read_text()), name
            owner = conn.execute(
                "SELECT pg_get_userbyid(datdba) FROM pg_database WHERE datname = %s", (database,)
            ).fetchone()
            assert owner == (user,)
    with psycopg.connect(**{**ADMIN, "user": apps["control-plane"][0], "dbname": apps["control-plane"][1]}) as conn:
        table_owner = conn.execute("SELECT tableowner FROM pg_tables WHERE tablename = 'tenants'").fetchone()
        conn.execute("CREATE TABLE IF NOT EXISTS workloads (id text)")  # it owns its database's schema
    assert table_owner == (apps["control-plane"][0],)
    mlflow_user = apps["mlflow"][0]
    for other in ("control-plane", "prefect"):  # no CONNECT on another app's database
        with pytest.raises(psycopg.OperationalError, match="permission denied for database"):
            psycopg.connect(**{**ADMIN, "user": mlflow_user, "dbname": apps[other][1]})


def test_a_rerun_after_a_rotation_sets_the_new_password(deployment):
    folder, _master, apps = deployment
    db_users.run(folder, sslmode="prefer")
    (folder / "prefect" / "password").write_text("a-new-password-from-secrets-manager")
    with admin() as conn:  # a privilege granted by hand meanwhile is taken away again
        conn.execute(f'ALTER ROLE "{apps["prefect"][0]}" CREATEDB')
    db_users.run(folder, sslmode="prefer")
    with admin() as conn:
        row = conn.execute(
            "SELECT rolpassword, rolcreatedb FROM pg_authid WHERE rolname = %s", (apps["prefect"][0],)
        ).fetchone()
    assert verifies(row[0], "a-new-password-from-secrets-manager") and row[1] is False


def test_a_missing_key_is_refused_by_name_before_anything_is_made(deployment):
    folder, _master, apps = deployment
    (folder / "mlflow" / "password").unlink()
    with pytest.raises(ValueError, match="mlflow/password: missing"):
        db_users.run(folder, sslmode="prefer")
    with admin() as conn:
        made = conn.execute("SELECT rolname FROM pg_roles WHERE rolname = ANY(%s)", ([u for u, _ in apps.values()],))
        assert made.fetchall() == []


def credentials(tmp_path):
    folder = tmp_path / "db"
    write(folder / "master", username="master", password="m")
    for name in db_users.APPS:
        write(folder / name, username=f"u_{name}", password="p", dbname="d", host="db.internal", port="5432")
    return folder


class Refused(Exception):
    pass


def test_with_the_ca_bundle_the_server_is_verified_against_it_and_its_name(tmp_path, monkeypatch):
    folder, bundle = credentials(tmp_path), tmp_path / "global-bundle.pem"
    bundle.write_text("-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n")
    seen = []

    def connect(**kwargs):
        seen.append(kwargs)
        raise Refused

    monkeypatch.setattr(psycopg, "connect", connect)
    with pytest.raises(Refused):
        db_users.run(folder, ca_bundle=bundle)
    assert seen[0]["sslmode"] == "verify-full" and seen[0]["sslrootcert"] == str(bundle)
    assert seen[0]["host"] == "db.internal"  # the name verify-full checks the certificate against
    with pytest.raises(Refused):
        db_users.run(folder)  # no bundle (a laptop): TLS required, the server not verified
    assert seen[1]["sslmode"] == "require" and "sslrootcert" not in seen[1]


def test_a_missing_or_empty_ca_bundle_is_refused_by_name_before_connecting(tmp_path, monkeypatch, capsys):
    folder = credentials(tmp_path)
    monkeypatch.setattr(psycopg, "connect", lambda **kw: pytest.fail("connected without a CA bundle"))
    missing = tmp_path / "rds-ca" / "global-bundle.pem"
    assert db_users.main([str(folder), "--ca-bundle", str(missing)]) == 1
    assert f"{missing}: no CA certificate" in capsys.readouterr().err
    missing.parent.mkdir()
    missing.write_text("")  # a ConfigMap key that is empty
    assert db_users.main([str(folder), "--ca-bundle", str(missing)]) == 1
    assert db_users.main([str(folder), "--ca-bundel", str(missing)]) == 2  # a misspelt option: usage
