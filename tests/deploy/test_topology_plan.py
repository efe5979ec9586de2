"""What the topology test (test_topology.py, slow) would run, checked without running it: every pod of
the rendered manifests has a command, resolves each env reference, runs as a non-root uid with a
memory limit, and no variable the kubelet adds on its own (Service links) overrides a JoyNexus
setting."""

from __future__ import annotations

import re

import pytest

from tests.deploy.render import REPO, rendered
from tests.deploy.topology_pods import HEAD_SVC, bootstrap_config_maps, external_secrets, plan_pods, service_link_env


def remote_value(key: str) -> dict[str, str] | str:
    """Secrets Manager, as the ExternalSecrets read it: a login object per app, strings elsewhere."""
    if key.endswith("ray-gcs-redis"):
        return "x"
    return {"username": "u", "password": "p%w", "dbname": "d", "host": "db", "port": "5432", "flask_secret_key": "k"}


def secrets_of(docs: list[dict]) -> dict[str, dict[str, str]]:
    """The Secrets the operator makes, plus joynexus-secrets (the admin key bootstrap-cluster writes)."""
    return {**external_secrets(docs, remote_value), "joynexus-secrets": {"JOYNEXUS_ADMIN_KEY": "x"}}


RDS_CA = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"


@pytest.fixture(scope="module")
def plans():
    docs = rendered() + bootstrap_config_maps(RDS_CA)
    services = [d["metadata"]["name"] for d in docs if d["kind"] == "Service"] + [HEAD_SVC]
    return plan_pods(docs, secrets_of(docs), REPO / "Dockerfile", {name: "10.0.0.1" for name in services}, {})


def _settings_read() -> set[str]:
    """Every JOYNEXUS_* name the package reads from its environment."""
    names = set()
    for path in (REPO / "joynexus").rglob("*.py"):
        names |= set(re.findall(r"[\"'](JOYNEXUS_[A-Z0-9_]+)[\"']", path.read_text()))
    return names


def test_every_pod_has_a_command_a_non_root_user_and_a_memory_limit(plans):
    names = {p.name for p in plans}
    workers = {f"joynexus-{role}-workers-worker" for role in ("training", "inference", "environment")}
    assert {"joynexus-head", "joynexus-api", "joynexus-services", *workers} <= names
    for plan in plans:
        assert plan.argv and plan.uid == 10001 and plan.memory_limit > 0, plan.name
    head = next(p for p in plans if p.name == "joynexus-head")
    assert head.argv[:3] == ["ray", "start", "--head"] and "RAY_REDIS_ADDRESS" in head.env  # GCS fault tolerance
    worker = next(p for p in plans if p.name == "joynexus-training-workers-worker")
    assert "--num-gpus=1" in worker.argv and worker.env["RAY_gcs_rpc_server_reconnect_timeout_s"] == "600"
    # the role's custom resource, as `ray start` gets it once KubeRay's bash has removed the quotes
    assert '--resources={"joynexus_training": 100}' in worker.argv


def test_no_variable_the_kubelet_adds_is_a_joynexus_setting(plans):
    # enableServiceLinks (default true) adds <SERVICE>_PORT=tcp://... for every Service of the
    # namespace: joynexus-prefect / joynexus-mlflow would set JOYNEXUS_PREFECT_PORT /
    # JOYNEXUS_MLFLOW_PORT, which joynexus.settings reads as integers.
    links = set(service_link_env({"joynexus-prefect": ("10.0.0.1", {"http": 4200})}))
    assert "JOYNEXUS_PREFECT_PORT" in links & _settings_read()  # the hazard is real
    for plan in plans:
        clash = {k for k in plan.env if k.endswith(("_PORT", "_SERVICE_HOST")) and k in _settings_read()}
        assert not clash, f"{plan.name}: the kubelet's Service links set {sorted(clash)} (enableServiceLinks: false)"


def test_the_operator_s_secrets_carry_each_app_s_own_login_url_encoded(plans):
    docs = rendered()
    made = secrets_of(docs)
    url = made["joynexus-db-control-plane"]["JOYNEXUS_DATABASE_URL"]
    assert url == "postgresql+psycopg://u:p%25w@db:5432/d?sslmode=require"  # Go's urlquery of 'p%w'
    db_users = next(p for p in plans if p.name == "joynexus-db-users")
    mounted = {v["target"]: v for v in db_users.volumes if v["kind"] == "secret"}
    assert mounted and all(v["read_only"] and v["files"] for v in mounted.values())
    master = set(made["joynexus-db-master"].values())
    for plan in plans:  # no pod but the db-users Job sees the master login
        if plan.name != "joynexus-db-users":
            files = [f for v in plan.volumes if v["kind"] == "secret" for f in v["files"].values()]
            assert not master & set(files), plan.name
    roles = ("training", "inference", "environment")
    ray_pods = ("joynexus-head", *(f"joynexus-{role}-workers-worker" for role in roles))
    for name in ray_pods:  # the service actors read their login here
        ray = next(p for p in plans if p.name == name)
        (login,) = [v for v in ray.volumes if v["kind"] == "secret"]
        assert login["files"] == {"JOYNEXUS_DATABASE_URL": url} and login["read_only"]
        assert ray.env["JOYNEXUS_DATABASE_URL_FILE"] == f"{login['target']}/JOYNEXUS_DATABASE_URL"


def test_the_db_users_job_verifies_the_database_against_the_mounted_rds_ca_bundle(plans):
    db_users = next(p for p in plans if p.name == "joynexus-db-users")
    assert "--ca-bundle" in db_users.argv, db_users.argv  # verify-full (joynexus/ops/db_users.py main)
    bundle = db_users.argv[db_users.argv.index("--ca-bundle") + 1]
    folder, name = bundle.rsplit("/", 1)
    (volume,) = [v for v in db_users.volumes if v["target"] == folder]
    assert volume["kind"] == "configMap" and volume["read_only"] and volume["files"] == {name: RDS_CA}
    bootstrap = (REPO / "infra" / "scripts" / "bootstrap-cluster").read_text()
    assert "create configmap joynexus-rds-ca" in bootstrap and "truststore.pki.rds.amazonaws.com" in bootstrap
