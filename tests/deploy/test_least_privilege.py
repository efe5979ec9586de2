"""Issue 29 items 4 and 6, offline: database credentials (per-app logins synced from Secrets Manager by
the External Secrets Operator, the RDS master only in the Job joynexus-db-users, no password in any
pod spec or in bootstrap-cluster), MLflow behind its basic-auth app, and S3 limited per role to its
prefixes and per tenant through the session tag joynexus-tenant."""

from __future__ import annotations

import re
import subprocess

import pytest
import yaml

from joynexus.ops import db_users
from tests.deploy.render import DEPLOYMENTS, REPO, by_key, pod_specs, rendered, rendered_text

MODULE = REPO / "infra" / "terraform" / "modules" / "eks-gpu"
BOOTSTRAP = REPO / "infra" / "scripts" / "bootstrap-cluster"
RENDER = REPO / "infra" / "scripts" / "render-deployment"
DB_SECRETS = {f"joynexus-db-{app}" for app in db_users.APPS} | {"joynexus-db-master"}
# The database logins each pod may read (anything else is a leak of another app's data).
ALLOWED_DB_SECRETS = {
    "Deployment/joynexus-api": {"joynexus-db-control-plane"},
    "Deployment/joynexus-prefect-worker": {"joynexus-db-control-plane"},
    "Job/joynexus-services": {"joynexus-db-control-plane"},
    # the service actors read the control plane's login from a mounted file, never as an actor argument
    "RayCluster/joynexus": {"joynexus-db-control-plane"},
    "Deployment/joynexus-mlflow": {"joynexus-db-mlflow"},
    "Deployment/joynexus-prefect": {"joynexus-db-prefect"},
    "Job/joynexus-db-users": DB_SECRETS,
}


def secrets_read(pod: dict) -> set[str]:
    """Every Secret a pod reads: env secretKeyRef, envFrom secretRef, secret volumes."""
    names = set()
    for container in pod.get("initContainers", []) + pod["containers"]:
        for env in container.get("env", []):
            ref = env.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                names.add(ref["name"])
        names |= {e["secretRef"]["name"] for e in container.get("envFrom", []) if "secretRef" in e}
    names |= {v["secret"]["secretName"] for v in pod.get("volumes", []) if "secret" in v}
    return names


def pods() -> list[tuple[str, dict]]:
    return [(label, pod) for doc in rendered() for label, pod in pod_specs(doc)]


def test_each_pod_reads_only_its_own_database_login_and_only_the_users_job_the_master():
    seen = set()
    for label, pod in pods():
        owner = "/".join(label.split("/")[:2])
        database_logins = secrets_read(pod) & DB_SECRETS
        assert database_logins <= ALLOWED_DB_SECRETS.get(owner, set()), label
        if database_logins:
            seen.add(owner)
        if "joynexus-db-master" in database_logins:
            assert owner == "Job/joynexus-db-users", label
    assert seen == set(ALLOWED_DB_SECRETS)  # every app found, with its login


def test_no_password_or_database_url_is_written_in_a_pod_spec_or_in_bootstrap():
    for label, pod in pods():
        for container in pod.get("initContainers", []) + pod["containers"]:
            for env in container.get("env", []):
                if "value" in env and env["name"].endswith("_FILE"):  # where a mounted Secret is read
                    assert env["value"].startswith("/var/run/secrets/"), (label, env)
                elif "value" in env:
                    assert not re.search(r"(PASSWORD|TOKEN|SECRET|DATABASE_URL|STORE_URI)", env["name"]), (label, env)
                    assert "://" not in env["value"] or "@" not in env["value"], (label, env)
            text = " ".join(container.get("command", []) + container.get("args", []))
            assert not re.search(r"postgres(ql)?(\+\w+)?://\w", text), label  # only "$VARIABLE" forms
    bootstrap = BOOTSTRAP.read_text() + RENDER.read_text()
    assert 'kubectl -n "$NS" run' not in bootstrap and "--overrides" not in bootstrap  # no createdb pod
    assert "get-secret-value" not in bootstrap  # no password passes through the script
    assert "postgresql" not in bootstrap


def test_every_secret_a_pod_reads_is_synced_from_secrets_manager_or_made_by_bootstrap():
    res = by_key(rendered())
    synced = {doc["spec"]["target"]["name"]: doc for (kind, _), doc in res.items() if kind == "ExternalSecret"}
    for label, pod in pods():
        for name in secrets_read(pod):
            assert name in synced or name == "joynexus-secrets", (label, name)
    assert "create secret generic joynexus-secrets" in BOOTSTRAP.read_text()
    for name, doc in synced.items():
        spec = doc["spec"]
        assert spec["secretStoreRef"] == {"name": "aws-secrets-manager", "kind": "SecretStore"}
        hours = re.fullmatch(r"(\d+)([hm])", spec["refreshInterval"])
        # RDS rotates the master every 7 days: a refresh every hour at most keeps the Secret current
        assert hours and int(hours.group(1)) / (60 if hours.group(2) == "m" else 1) <= 1, name
    assert ("SecretStore", "aws-secrets-manager") in res
    # the master comes from the RDS-managed secret (its ARN: bootstrap's patch), the apps from Terraform's
    master = synced["joynexus-db-master"]["spec"]["dataFrom"][0]["extract"]["key"]
    assert master.startswith("rds!db-")
    bootstrap = BOOTSTRAP.read_text() + RENDER.read_text()  # bootstrap applies what render-deployment prints
    assert 'DB_SECRET="$(tf database_secret_arn)"' in bootstrap and '{extract: {key: "${DB_SECRET}"}}' in bootstrap
    assert 'sed -e "s#key: joynexus/#key: ${CLUSTER}/#"' in bootstrap
    database_tf = (MODULE / "database.tf").read_text()
    assert 'name                    = "${var.cluster_name}/db/${each.key}"' in database_tf
    apps = set(re.findall(r"^\s+([\w-]+)\s+= \{ username = ", database_tf, re.M))
    assert apps == set(db_users.APPS)
    for app in db_users.APPS:
        assert synced[f"joynexus-db-{app}"]["spec"]["dataFrom"][0]["extract"]["key"] == f"joynexus/db/{app}"


def test_the_users_job_mounts_what_db_users_reads_and_the_templates_make_each_app_url():
    res = by_key(rendered())
    job = res[("Job", "joynexus-db-users")]["spec"]["template"]["spec"]
    container = job["containers"][0]
    folder = container["command"][3]  # then --ca-bundle <the RDS CA bundle> (test_topology_plan.py)
    assert container["command"][:3] == ["python", "-m", "joynexus.ops.db_users"]
    volumes = {v["name"]: v["secret"] for v in job["volumes"] if "secret" in v}
    mounts = {m["mountPath"]: volumes[m["name"]] for m in container["volumeMounts"] if m["name"] in volumes}
    assert set(mounts) == {f"{folder}/master"} | {f"{folder}/{app}" for app in db_users.APPS}
    assert mounts[f"{folder}/master"]["secretName"] == "joynexus-db-master"
    for path, secret in mounts.items():
        assert secret["defaultMode"] == 0o440  # the group (fsGroup 10001) reads, nobody else
        keys = {item["key"] for item in secret["items"]}
        assert {item["path"] for item in secret["items"]} == keys
        if path.endswith("/master"):
            assert keys == {"username", "password"}  # the RDS-managed secret's own keys
            continue
        app = path.rsplit("/", 1)[1]
        template = res[("ExternalSecret", f"joynexus-db-{app}")]["spec"]["target"]["template"]["data"]
        assert keys == {"username", "password", "dbname", "host", "port"} <= set(template)
    urls = {
        "control-plane": ("JOYNEXUS_DATABASE_URL", "postgresql+psycopg://", "sslmode=require"),
        "mlflow": ("MLFLOW_BACKEND_STORE_URI", "postgresql+psycopg://", "sslmode=require"),
        "prefect": ("PREFECT_API_DATABASE_CONNECTION_URL", "postgresql+asyncpg://", "ssl=require"),
    }
    for app, (key, scheme, tls) in urls.items():
        url = res[("ExternalSecret", f"joynexus-db-{app}")]["spec"]["target"]["template"]["data"][key]
        assert url.startswith(scheme) and url.endswith(tls), app
        assert "{{ .password | urlquery }}" in url and "{{ .username }}" in url, app


def test_mlflow_runs_basic_auth_and_every_mlflow_client_has_the_login(tmp_path, monkeypatch):
    res = by_key(rendered())
    mlflow = res[("Deployment", "joynexus-mlflow")]["spec"]["template"]["spec"]["containers"][0]
    script = mlflow["args"][0]
    assert "exec mlflow server --app-name basic-auth" in script
    env = {e["name"]: e for e in mlflow["env"]}
    for name, key in (("MLFLOW_AUTH_ADMIN_USERNAME", "MLFLOW_TRACKING_USERNAME"),
                      ("MLFLOW_AUTH_ADMIN_PASSWORD", "MLFLOW_TRACKING_PASSWORD"),
                      ("MLFLOW_FLASK_SERVER_SECRET_KEY", "MLFLOW_FLASK_SERVER_SECRET_KEY")):  # fmt: skip
        assert env[name]["valueFrom"]["secretKeyRef"] == {"name": "joynexus-mlflow-auth", "key": key}
    assert env["MLFLOW_AUTH_CONFIG_PATH"]["value"].startswith("/tmp/")  # the writable emptyDir
    # the config the container writes, parsed by MLflow's own reader
    writes = re.search(r"umask 077 && (printf .*?) && exec", script, re.S).group(1)
    config = tmp_path / "basic_auth.ini"
    url = "postgresql+psycopg://mlflow:p%40ss@db.internal:5432/mlflow?sslmode=require"  # an escaped password
    written = subprocess.run(["sh", "-c", writes], capture_output=True, text=True, timeout=30,
                             env={"MLFLOW_BACKEND_STORE_URI": url, "MLFLOW_AUTH_CONFIG_PATH": str(config),
                                  "PATH": "/usr/bin:/bin"})  # fmt: skip
    assert written.returncode == 0, written.stderr
    # the image installs mlflow[auth] (Flask-WTF), without which the basic-auth app does not start
    assert '"mlflow[auth]==' in (REPO / "pyproject.toml").read_text()
    assert "Flask-WTF==" in (REPO / "requirements" / "lock.txt").read_text()
    pytest.importorskip("flask_wtf", reason="mlflow[auth] is not installed here yet: run scripts/bootstrap")
    from mlflow.server.auth.config import read_auth_config
    from mlflow.server.auth.permissions import NO_PERMISSIONS

    monkeypatch.setenv("MLFLOW_AUTH_CONFIG_PATH", str(config))
    auth = read_auth_config()
    assert auth.database_uri == url and auth.default_permission == NO_PERMISSIONS.name
    # every pod NetworkPolicy lets reach MLflow logs in with the same login
    clients = 0
    for doc in rendered():
        for label, pod in pod_specs(doc):
            template_labels = (
                doc["spec"]["template"]["metadata"]["labels"] if doc["kind"] in ("Deployment", "Job") else None
            )
            if doc["kind"] == "RayCluster":
                template_labels = {"joynexus.io/mlflow-client": "true"}  # head and workers carry it
            if (template_labels or {}).get("joynexus.io/mlflow-client") != "true":
                continue
            clients += 1
            for container in pod["containers"]:
                refs = {e["name"]: e.get("valueFrom", {}).get("secretKeyRef", {}) for e in container.get("env", [])}
                for name in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
                    assert refs.get(name) == {"name": "joynexus-mlflow-auth", "key": name}, (label, name)
    assert clients >= 5  # API, Prefect worker, services Job, Ray head and GPU workers


def terraform_block(text: str, kind: str, name: str) -> str:
    found = re.search(rf'{kind} "{name}" \{{(.*?)\n\}}', text, re.S)
    assert found, (kind, name)
    return found.group(1)


def test_s3_access_is_per_prefix_and_per_tenant_through_the_session_tag():
    iam = (MODULE / "iam.tf").read_text()
    artifacts = terraform_block(iam, 'data "aws_iam_policy_document"', "artifacts")
    assert "aws_s3_bucket.artifacts.arn}/*" not in artifacts  # no role reaches the whole bucket
    assert re.search(r'"\$\{aws_s3_bucket\.artifacts\.arn\}/\$\{prefix\}/\*"', artifacts)
    assert re.search(r'ray\s+= \{ write = \["checkpoints", "mlflow"\], read = \["datasets"\] \}', iam)
    assert re.search(r'mlflow\s+= \{ write = \["mlflow"\], read = \[\] \}', iam)
    # flow runs (the Prefect worker's pod) log evaluations and sweeps to MLflow, its artifacts in S3
    assert re.search(r'prefect-worker\s+= \{ write = \["mlflow"\], read = \[\] \}', iam)
    assert re.search(
        r'prefect-worker\s+= \{ namespace = var.namespace, service_account = "joynexus-prefect-worker" \}', iam
    )
    worker = by_key(rendered())[("Deployment", "joynexus-prefect-worker")]["spec"]["template"]["spec"]
    assert worker["serviceAccountName"] == "joynexus-prefect-worker"
    # the API keeps tenants' uploads under datasets/ for the Master (joynexus/data/shared_uploads.py)
    assert re.search(r'api\s+= \{ write = \["datasets"\], read = \["checkpoints"\] \}', iam)
    shared = (REPO / "joynexus" / "data" / "shared_uploads.py").read_text()
    assert '"datasets"]' in shared and 'f"{tenant_id}/uploads"' in shared
    # the settings the prefixes come from
    settings = (REPO / "joynexus" / "settings.py").read_text()
    assert 'self._s3_uri("checkpoints")' in settings and 'self._s3_uri("mlflow")' in settings
    assert "JOYNEXUS_S3_PREFIX" not in yaml.safe_dump(by_key(rendered())[("ConfigMap", "joynexus-config")])
    tenant = terraform_block(iam, 'data "aws_iam_policy_document"', "tenant_artifacts")
    s3_resources = re.findall(r'"\$\{aws_s3_bucket\.artifacts\.arn\}/([^"]+)"', tenant)
    assert s3_resources and all("$${aws:PrincipalTag/joynexus-tenant}/" in r for r in s3_resources)
    prefixes = re.search(r'variable = "s3:prefix"\s+values\s+= \[([^\]]+)\]', tenant).group(1)
    assert all("$${aws:PrincipalTag/joynexus-tenant}/" in p for p in re.findall(r'"([^"]+)"', prefixes))
    trust = terraform_block(iam, 'data "aws_iam_policy_document"', "tenant_artifacts_assume")
    assert 'identifiers = [aws_iam_role.pod["ray"].arn]' in trust
    assert 'variable = "aws:RequestTag/joynexus-tenant"' in trust and 'values   = ["joynexus-tenant"]' in trust
    assert '"sts:TagSession"' in trust


def test_the_secret_syncer_reads_only_the_deployments_secrets():
    iam = (MODULE / "iam.tf").read_text()
    policy = terraform_block(iam, 'data "aws_iam_policy_document"', "external_secrets")
    assert '"*"' not in policy
    for secret in ("aws_db_instance.this.master_user_secret[0].secret_arn", "aws_secretsmanager_secret.gcs.arn",
                   "aws_secretsmanager_secret.mlflow_auth.arn", "aws_secretsmanager_secret.db_app"):  # fmt: skip
        assert secret in policy, secret
    assert '"kms:ViaService"' in policy


def test_the_validator_knows_the_external_secrets_crds():
    from tests.deploy.test_schemas import validate

    broken = rendered_text(DEPLOYMENTS).replace("refreshInterval: 1h", "refreshIntervall: 1h", 1)
    errors = validate(broken)
    assert any(e.startswith("ExternalSecret/") and "refreshIntervall" in e for e in errors), errors
