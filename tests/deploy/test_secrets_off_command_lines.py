"""Issue 43.8: no secret value on a process's command line (the head's dashboard serves every head
process's command line, `ps` shows them on the node) and none as a service actor's argument (Ray keeps
those in the GCS, with fault tolerance in its Redis). Every pod of the rendered manifests is planned as
the topology test would start it (KubeRay's `ray start` included, its `$REDIS_PASSWORD` expanded), with
a distinct value for every key of every Secret; the one value Ray itself puts on a command line (the
GCS Redis token, `ray start --redis-password`, Ray 2.60 has no file or environment form) is named."""

from __future__ import annotations

import secrets as random_tokens

from tests.deploy.render import REPO, rendered
from tests.deploy.topology_pods import HEAD_SVC, bootstrap_config_maps, external_secrets, plan_pods

RDS_CA = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"
RAY_PUTS_ON_ITS_COMMAND_LINE = {("joynexus-head", "--redis-password=")}  # docs/deployment.md, Known limits


def _distinct_remote(key: str) -> dict[str, str] | str:
    """Secrets Manager with a fresh value per field, so a leaked value names the field it came from."""
    token = random_tokens.token_hex(12)
    if key.endswith("ray-gcs-redis"):
        return f"gcs-{token}"
    fields = ("username", "password", "dbname", "host", "port", "flask_secret_key")
    return {field: f"{field}-{token}" for field in fields}


def _plans_and_values() -> tuple[list, dict[str, str]]:
    docs = rendered() + bootstrap_config_maps(RDS_CA)
    made = {**external_secrets(docs, _distinct_remote), "joynexus-secrets": {"JOYNEXUS_ADMIN_KEY": "admin-" + "k" * 24}}
    services = [d["metadata"]["name"] for d in docs if d["kind"] == "Service"] + [HEAD_SVC]
    plans = plan_pods(docs, made, REPO / "Dockerfile", {name: "10.0.0.1" for name in services}, {})
    # What would leak: each value, and the password fields alone (an URL carries them inside)
    values = {f"{secret}/{key}": value for secret, data in made.items() for key, value in data.items()}
    values |= {f"{key}@{secret}": value for secret, data in made.items() for key, value in data.items()}
    return plans, {where: v for where, v in values.items() if len(v) >= 8 and not v.isdigit()}


def test_no_container_command_or_argument_carries_a_secret_value():
    plans, values = _plans_and_values()
    passwords = {where: v for where, v in values.items() if "password" in where.lower() or "gcs-" in v}
    assert any("JOYNEXUS_DATABASE_URL" in where for where in values) and passwords  # the check has teeth
    leaks = set()
    for plan in plans:
        for arg in plan.argv:
            for where, value in values.items():
                if value in arg:
                    leaks.add((plan.name, arg.split(value)[0], where.split("@")[-1].split("/")[0]))
    named = {(pod, prefix) for pod, prefix, _ in leaks}
    # equal, not a subset: the scan finds the one value Ray puts there (and would find a second)
    assert named == RAY_PUTS_ON_ITS_COMMAND_LINE, sorted(leaks)
    # ... and that one is the GCS token only, on the head only (the workers never hold it)
    assert {secret for _, _, secret in leaks} <= {"joynexus-ray-gcs"}, sorted(leaks)


def test_the_ray_pods_hold_the_database_login_as_a_mounted_file_not_in_their_environment():
    plans, values = _plans_and_values()
    logins = {v for where, v in values.items() if where.startswith("joynexus-db-")}
    roles = ("training", "inference", "environment")
    ray_pods = ("joynexus-head", *(f"joynexus-{role}-workers-worker" for role in roles))
    for name in ray_pods:
        ray = next(p for p in plans if p.name == name)
        assert not logins & set(ray.env.values()), name  # every process of the pod inherits its env
        path = ray.env["JOYNEXUS_DATABASE_URL_FILE"]
        files = {f"{v['target']}/{f}": c for v in ray.volumes if v["kind"] == "secret" for f, c in v["files"].items()}
        assert files[path].startswith("postgresql+psycopg://") and path.startswith("/var/run/secrets/")
