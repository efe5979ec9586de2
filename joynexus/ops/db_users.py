"""Per-application PostgreSQL users (issue 29 item 4): the Job `joynexus-db-users`
(deployments/database/db-users.yaml) runs `python -m joynexus.ops.db_users /var/run/joynexus/db
--ca-bundle /etc/joynexus/rds-ca/global-bundle.pem`: TLS to RDS with its certificate verified against
the RDS CA bundle (the ConfigMap joynexus-rds-ca, made by infra/scripts/bootstrap-cluster) and its
name against the endpoint (libpq's verify-full): the master's session and the apps' password verifiers
cross that connection, so no stand-in server may answer it.

Each application (the control plane, MLflow, Prefect) logs in as its own role, owner of its own
database only: LOGIN, no superuser, no CREATEDB / CREATEROLE, and PUBLIC's CONNECT on every app
database revoked, so one app's credential opens no other app's data. The RDS master credential
(generated and rotated by RDS in Secrets Manager) is used by this Job alone.

Credentials are read at run time from files: the Secrets the External Secrets Operator keeps in
sync with Secrets Manager, mounted as volumes (`<folder>/master/{username,password}`,
`<folder>/<app>/{username,password,dbname,host,port}`), never from the pod spec. Passwords are sent
as SCRAM-SHA-256 verifiers computed here by libpq (what psql's `\\password` does), so no clear text
reaches the server or its statement log. Idempotent: run again after a password change (rotation).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

APPS = ("control-plane", "mlflow", "prefect")


@dataclass(frozen=True)
class Credential:
    username: str
    password: str
    dbname: str | None = None
    host: str | None = None
    port: int | None = None


def read_credential(folder: Path) -> Credential:
    """A mounted Secret's keys as a credential; a missing or empty key is an error naming the file."""

    def key(name: str, required: bool = True) -> str | None:
        path = folder / name
        value = path.read_text().strip() if path.is_file() else ""
        if not value and required:
            raise ValueError(f"{path}: missing or empty (the Secret synced by the External Secrets Operator)")
        return value or None

    port = key("port", required=False)
    return Credential(
        username=str(key("username")),
        password=str(key("password")),
        dbname=key("dbname", required=False),
        host=key("host", required=False),
        port=int(port) if port else None,
    )


def ensure_app_user(conn, app: Credential, *, all_databases: tuple[str, ...] = ()) -> None:
    """Create or update `app`'s role and database (`conn`: autocommit, as a role with CREATEROLE and
    CREATEDB that owns or may take over the database). The role gets only LOGIN and its database."""
    from psycopg import sql

    if not app.dbname:
        raise ValueError(f"credential of {app.username!r}: dbname is required")
    role, database = sql.Identifier(app.username), sql.Identifier(app.dbname)
    verifier = sql.Literal(scram_verifier(conn, app.password, app.username))
    found = conn.execute(
        "SELECT rolsuper OR rolreplication OR rolbypassrls FROM pg_roles WHERE rolname = %s", (app.username,)
    ).fetchone()
    if found is None:
        conn.execute(
            sql.SQL("CREATE ROLE {} WITH LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION PASSWORD {}").format(
                role, verifier
            )
        )
    elif found[0]:  # only a superuser could take these away: refuse rather than hand them to an app
        raise ValueError(f"role {app.username!r} exists with SUPERUSER, REPLICATION or BYPASSRLS: drop or fix it")
    else:  # (PostgreSQL lets only superusers even restate NOSUPERUSER / NOREPLICATION)
        conn.execute(sql.SQL("ALTER ROLE {} WITH LOGIN NOCREATEDB NOCREATEROLE PASSWORD {}").format(role, verifier))
    # The creating role becomes a member, so it may make the role an owner (PostgreSQL requires it).
    conn.execute(sql.SQL("GRANT {} TO CURRENT_USER").format(role))
    if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (app.dbname,)).fetchone():
        conn.execute(sql.SQL("ALTER DATABASE {} OWNER TO {}").format(database, role))
    else:
        conn.execute(sql.SQL("CREATE DATABASE {} OWNER {}").format(database, role))
    conn.execute(sql.SQL("REVOKE ALL ON DATABASE {} FROM PUBLIC").format(database))
    conn.execute(sql.SQL("GRANT CONNECT, TEMPORARY ON DATABASE {} TO {}").format(database, role))


def take_over_objects(conn, app: Credential) -> int:
    """In the app's database (`conn` connected to it): tables, views, sequences and enum types of the
    `public` schema still owned by the connecting (master) role pass to the app's role (a deployment
    made before per-app users). Returns how many changed owner."""
    from psycopg import sql

    role = sql.Identifier(app.username)
    relations = conn.execute(
        "SELECT c.relname FROM pg_class c WHERE c.relnamespace = 'public'::regnamespace "
        "AND c.relkind IN ('r', 'p', 'v', 'm', 'S') "
        "AND c.relowner = (SELECT oid FROM pg_roles WHERE rolname = current_user)"
    ).fetchall()
    for (name,) in relations:
        conn.execute(sql.SQL("ALTER TABLE public.{} OWNER TO {}").format(sql.Identifier(name), role))
    types = conn.execute(
        "SELECT t.typname FROM pg_type t WHERE t.typnamespace = 'public'::regnamespace AND t.typtype = 'e' "
        "AND t.typowner = (SELECT oid FROM pg_roles WHERE rolname = current_user)"
    ).fetchall()
    for (name,) in types:
        conn.execute(sql.SQL("ALTER TYPE public.{} OWNER TO {}").format(sql.Identifier(name), role))
    return len(relations) + len(types)


def scram_verifier(conn, password: str, username: str) -> str:
    """The SCRAM-SHA-256 verifier of `password`, computed by libpq on the client (PQencryptPasswordConn)."""
    verifier = conn.pgconn.encrypt_password(password.encode(), username.encode(), b"scram-sha-256").decode()
    if not verifier.startswith("SCRAM-SHA-256$"):
        raise RuntimeError("libpq did not produce a SCRAM-SHA-256 verifier")
    return verifier


def connect_as(
    master: Credential, host: str, port: int, dbname: str, sslmode: str = "require", ca_bundle: Path | None = None
):
    """A connection as `master`; with `ca_bundle`, TLS with the server's certificate verified
    against it and its name checked against `host` (libpq's verify-full)."""
    import psycopg

    tls = {"sslmode": "verify-full", "sslrootcert": str(ca_bundle)} if ca_bundle else {"sslmode": sslmode}
    return psycopg.connect(
        host=host, port=port, dbname=dbname, user=master.username, password=master.password,
        autocommit=True, connect_timeout=10, **tls,
    )  # fmt: skip


def check_ca_bundle(path: Path) -> Path:
    """The CA bundle the server's certificate is verified against: it must hold a certificate."""
    text = path.read_text(errors="replace") if path.is_file() else ""
    if "-----BEGIN CERTIFICATE-----" not in text:
        raise ValueError(f"{path}: no CA certificate (the ConfigMap joynexus-rds-ca, the RDS CA bundle)")
    return path


def run(
    folder: Path, *, sslmode: str = "require", ca_bundle: Path | None = None, maintenance_db: str = "postgres"
) -> list[str]:
    """Every app's user and database from the credentials under `folder`; returns a line per app.
    `ca_bundle`: verify the server (verify-full) instead of `sslmode`."""
    master = read_credential(folder / "master")
    apps = {name: read_credential(folder / name) for name in APPS}
    first = apps[APPS[0]]
    if not first.host:
        raise ValueError(f"{folder / APPS[0] / 'host'}: missing (the database endpoint)")
    if ca_bundle is not None:
        check_ca_bundle(ca_bundle)
    host, port = first.host, first.port or 5432
    done = []
    with connect_as(master, host, port, maintenance_db, sslmode, ca_bundle) as conn:
        for app in apps.values():
            ensure_app_user(conn, app)
    for name, app in apps.items():
        with connect_as(master, host, port, str(app.dbname), sslmode, ca_bundle) as conn:
            moved = take_over_objects(conn, app)
        done.append(f"{name}: role {app.username} owns database {app.dbname} ({moved} objects taken over)")
    return done


USAGE = "usage: python -m joynexus.ops.db_users <folder of mounted credentials> [--ca-bundle <PEM file>]"


def main(argv: list[str]) -> int:
    """`<folder> [--ca-bundle PEM]`: with a CA bundle (the Job: the RDS bundle), the server's
    certificate and name are verified (verify-full); without, TLS is only required."""
    if len(argv) not in (1, 3) or (len(argv) == 3 and argv[1] != "--ca-bundle"):
        print(USAGE, file=sys.stderr)
        return 2
    ca_bundle = Path(argv[2]) if len(argv) == 3 else None
    try:
        for line in run(Path(argv[0]), ca_bundle=ca_bundle):
            print(line)
    except ValueError as error:
        print(f"joynexus db-users: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
