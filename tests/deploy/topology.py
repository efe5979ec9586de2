"""The topology of tests/deploy/test_topology.py: the cloud stand-ins, the manifests rendered through
the same overlay infra/scripts/bootstrap-cluster applies (bucket, region, GCS Redis address), the
Secrets it writes, and the pods, each started as its manifest says (tests/deploy/podexec.py)."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

from tests.deploy import topology_host as host
from tests.deploy.render import DEPLOYMENTS, REPO
from tests.deploy.topology_pods import (
    HEAD_SVC,
    NAMESPACE,
    PodPlan,
    bootstrap_config_maps,
    external_secrets,
    plan_pods,
)

VENV = Path(sys.prefix)  # the image's /opt/venv
DB_HOST = "joynexus-db.topology.internal"  # RDS
GCS_HOST = "joynexus-gcs.topology.internal"  # ElastiCache (the GCS store)
S3_HOST = "s3.topology.internal"  # S3
S3_PORT = 9000
BUCKET = "joynexus-artifacts-topology"
REGION = "eu-west-1"
DB_USER = "joynexus_master"  # the RDS master user bootstrap-cluster reads from Secrets Manager
# iam.tf: the Pod Identity associations
S3_ROLES = ("joynexus-ray", "joynexus-mlflow", "joynexus-api", "joynexus-prefect-worker")

OVERLAY = """apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources: [base]
patches:
  - patch: |-
      apiVersion: v1
      kind: ConfigMap
      metadata: {{name: joynexus-config}}
      data: {{JOYNEXUS_S3_BUCKET: "{bucket}", AWS_REGION: "{region}", AWS_DEFAULT_REGION: "{region}"}}
  - patch: |-
      apiVersion: ray.io/v1
      kind: RayCluster
      metadata: {{name: joynexus}}
      spec: {{gcsFaultToleranceOptions: {{redisAddress: "{redis}"}}}}
"""


def render_overlay(base: Path) -> list[dict]:
    """`kubectl kustomize` of bootstrap-cluster's overlay over a copy of deployments/."""
    overlay = base / "overlay"
    shutil.copytree(DEPLOYMENTS, overlay / "base")
    redis = f"rediss://{GCS_HOST}:6379"
    (overlay / "kustomization.yaml").write_text(OVERLAY.format(bucket=BUCKET, region=REGION, redis=redis))
    done = subprocess.run(["kubectl", "kustomize", str(overlay)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return [d for d in yaml.safe_load_all(done.stdout) if d]


def pod_labels(docs: list[dict]) -> dict[str, dict]:
    """Pod name (as plan_pods names it) -> the labels of its template (KubeRay's on the Ray pods)."""
    labels = {}
    for d in docs:
        name = d["metadata"]["name"]
        if d["kind"] in ("Deployment", "Job"):
            labels[name] = d["spec"]["template"]["metadata"].get("labels", {})
        elif d["kind"] == "RayCluster":
            labels[f"{name}-head"] = {"ray.io/cluster": name, "ray.io/node-type": "head"}
            for g in d["spec"].get("workerGroupSpecs", []):
                labels[f"{name}-{g['groupName']}-worker"] = {"ray.io/cluster": name, "ray.io/node-type": "worker"}
    return labels


class Topology:
    def __init__(self, base: Path):
        self.base = base
        self.run = f"{os.getpid() % 100000}"
        self.password = secrets.token_hex(12)
        self.redis_password = secrets.token_hex(12)
        self.admin_key = "jnx-admin-" + secrets.token_hex(12)
        logins = ("control-plane", "mlflow", "prefect", "mlflow-auth", "flask")
        self.app_passwords = {k: secrets.token_hex(12) for k in logins}
        self.s3_key = ("topology", secrets.token_hex(8))
        self.closers: list = []
        self.started = time.monotonic()

    # -- the cloud -------------------------------------------------------------------------------
    def up_cloud(self) -> None:
        subnet = f"10.29.{20 + os.getpid() % 200}"
        self.network = host.Network(self.run, subnet)
        self.closers.append(self.network.close)
        self.cgroups = host.MemoryCgroups(self.run, cpu_requests=self.cpu_requests())
        self.closers.append(self.cgroups.close)
        gw = self.network.gateway
        certs = self.base / "certs"
        certs.mkdir()
        cert, key = host.self_signed(certs, [DB_HOST, GCS_HOST])
        self.ca_cert = cert  # the stand-ins' CA (self-signed): RDS's CA bundle here
        self.pg = self.base / "pg"
        self.pgdata = host.start_postgres(self.pg, gw, cert, key, secrets.token_hex(8))
        self.closers.append(lambda: host.stop_postgres(self.pgdata))
        # RDS's master user (CREATEDB, CREATEROLE, no superuser) and its initial database (database.tf's
        # db_name); the Job joynexus-db-users makes each app's role and the other databases.
        host.psql(self.pg, f"CREATE ROLE {DB_USER} LOGIN CREATEDB CREATEROLE PASSWORD '{self.password}'")
        host.psql(self.pg, f"CREATE DATABASE joynexus OWNER {DB_USER}")
        self._start_process("redis", ["redis-server", "--port", "0", "--tls-port", "6379", "--bind", gw,
                                      "--tls-cert-file", str(cert), "--tls-key-file", str(key),
                                      "--tls-auth-clients", "no", "--requirepass", self.redis_password,
                                      "--save", "", "--appendonly", "no", "--dir", str(self.base)])  # fmt: skip
        moto = VENV / "bin" / "moto_server"
        # the pods' endpoint is a name (as S3's is): moto reads a Host it does not know as a bucket
        s3_env = {**os.environ, "MOTO_S3_CUSTOM_ENDPOINTS": f"http://{S3_HOST}:{S3_PORT}"}
        self._start_process("s3", [str(moto), "-H", gw, "-p", str(S3_PORT)], s3_env)
        self.trust_store = host.trust_store(self.base / "ssl-certs", cert)  # the image's + the stand-ins' CA
        self.s3 = self._s3_client()
        self._wait(
            lambda: self.s3.create_bucket(Bucket=BUCKET, CreateBucketConfiguration={"LocationConstraint": REGION}), "S3"
        )

    def _start_process(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        log = open(self.base / f"{name}.log", "ab")
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        self.closers.append(lambda: (proc.kill(), proc.wait(timeout=30)))

    def _s3_client(self):
        import boto3

        return boto3.client("s3", endpoint_url=f"http://{self.network.gateway}:{S3_PORT}", region_name=REGION,
                            aws_access_key_id=self.s3_key[0], aws_secret_access_key=self.s3_key[1])  # fmt: skip

    @staticmethod
    def _wait(call, what: str, timeout_s: float = 60.0):
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return call()
            except Exception:
                if time.monotonic() > deadline:
                    raise AssertionError(f"{what} did not come up in {timeout_s:.0f}s") from None
                time.sleep(0.5)

    @staticmethod
    def cpu_requests() -> float:
        from tests.deploy.render import pod_specs, rendered
        from tests.deploy.topology_pods import cpu_cores

        return sum(cpu_cores(c.get("resources", {}).get("requests", {}).get("cpu", "0"))
                   for doc in rendered() for _, spec in pod_specs(doc) for c in spec["containers"])  # fmt: skip

    # -- the manifests -----------------------------------------------------------------------------
    def secrets(self, docs: list[dict]) -> dict[str, dict[str, str]]:
        """What the External Secrets Operator makes from the rendered ExternalSecrets over this
        topology's Secrets Manager values (the RDS master login, one login per app, the GCS token,
        MLflow's auth), plus joynexus-secrets (the admin key bootstrap-cluster writes)."""
        apps = {"control-plane": "joynexus", "mlflow": "mlflow", "prefect": "prefect"}

        def remote(key: str) -> dict[str, str] | str:
            if key.startswith("rds!"):
                return {"username": DB_USER, "password": self.password}
            if key.endswith("ray-gcs-redis"):
                return self.redis_password
            if key.endswith("mlflow-auth"):
                return {"username": "admin", "password": self.app_passwords["mlflow-auth"],
                        "flask_secret_key": self.app_passwords["flask"]}  # fmt: skip
            app = key.rsplit("/db/", 1)[-1]
            return {"username": f"jnx_{app.replace('-', '_')}", "password": self.app_passwords[app],
                    "dbname": apps[app], "host": DB_HOST, "port": "5432"}  # fmt: skip

        return {**external_secrets(docs, remote), "joynexus-secrets": {"JOYNEXUS_ADMIN_KEY": self.admin_key}}

    def plan(self) -> dict[str, PodPlan]:
        self.docs = render_overlay(self.base) + bootstrap_config_maps(self.ca_cert.read_text())
        for d in self.docs:
            d["metadata"].setdefault("uid", f"topology-{self.run}")  # the API server's uid (KubeRay: GCS namespace)
        self.pods = host.Pods(self.base, self.network, self.cgroups, self._image_mounts())
        self.closers.insert(2, self.pods.close)  # before the network and cgroups go
        labels = pod_labels(self.docs)
        for pod in labels:
            self.pods.address(pod)
        service_ips = {HEAD_SVC: self.pods.ips["joynexus-head"]}
        for d in self.docs:
            if d["kind"] == "Service":
                selector = d["spec"]["selector"].items()
                (pod,) = [p for p, lab in labels.items() if selector <= lab.items()]
                service_ips[d["metadata"]["name"]] = self.pods.ips[pod]
        self.service_ips = service_ips
        self._write_hosts(service_ips)
        identity = {"AWS_ACCESS_KEY_ID": self.s3_key[0], "AWS_SECRET_ACCESS_KEY": self.s3_key[1],
                    "AWS_ENDPOINT_URL_S3": f"http://{S3_HOST}:{S3_PORT}"}  # fmt: skip
        platform = {role: identity for role in S3_ROLES}
        self.secret_data = self.secrets(self.docs)
        plans = plan_pods(self.docs, self.secret_data, REPO / "Dockerfile", service_ips, platform)
        self.plans = {p.name: p for p in plans}
        return self.plans

    def _write_hosts(self, service_ips: dict[str, str]) -> None:
        lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost ip6-loopback"]
        for name, ip in service_ips.items():
            lines.append(f"{ip} {name} {name}.{NAMESPACE} {name}.{NAMESPACE}.svc {name}.{NAMESPACE}.svc.cluster.local")
        lines.append(f"{self.network.gateway} {DB_HOST} {GCS_HOST} {S3_HOST}")
        self.hosts = self.base / "hosts"
        self.hosts.write_text("\n".join(lines) + "\n")
        records = {name: line.split()[0] for line in lines[2:] for name in line.split()[1:]}
        self.dns = host.ClusterDns(self.network.gateway, records)
        self.closers.append(self.dns.close)
        search = f"{NAMESPACE}.svc.cluster.local svc.cluster.local cluster.local"
        (self.base / "resolv.conf").write_text(f"search {search}\nnameserver {self.network.gateway}\noptions ndots:5\n")

    def _image_mounts(self) -> list[dict]:
        """The image's paths: /opt/venv (the venv), /opt/joynexus (this checkout, read-only), and the
        checkout over the venv's editable-install path when that is another tree."""

        def ro(source: Path | str, target: Path | str) -> dict:
            return {"kind": "bind", "source": str(source), "target": str(target), "read_only": True}

        mounts = [ro(self.hosts_path(), "/etc/hosts"), ro(self.base / "resolv.conf", "/etc/resolv.conf"),
                  ro(self.trust_store, host.SYSTEM_CA.parent), ro(VENV, "/opt/venv"), *self._interpreter_mounts(),
                  ro(REPO, "/opt/joynexus")]  # fmt: skip
        mounts += self._editable_mounts()
        installed = VENV.parent
        if installed.resolve() != REPO.resolve() and (installed / "joynexus").is_dir():
            (REPO / VENV.name).mkdir(exist_ok=True)  # the mount point of the venv inside the checkout
            mounts += [{"kind": "bind", "source": str(REPO), "target": str(installed), "read_only": True},
                       {"kind": "bind", "source": "/opt/venv", "target": str(VENV), "read_only": True}]  # fmt: skip
        return mounts

    @staticmethod
    def _editable_mounts() -> list[dict]:
        """This checkout's packages over the folders the venv's editable install maps them to, when
        those are another tree's: a git worktree whose .venv links to the main checkout's venv would
        otherwise run the main checkout's code in every pod (the finder's MAPPING is absolute)."""
        import ast
        import re

        mounts = []
        site = next(Path(sys.prefix).resolve().glob("lib/python*/site-packages"), None)
        for finder in sorted(site.glob("__editable___*_finder.py")) if site else []:
            found = re.search(r"^MAPPING: dict\[str, str\] = (\{.*\})$", finder.read_text(), re.M)
            for target in ast.literal_eval(found.group(1)).values() if found else []:
                target = Path(target)
                root = next((p for p in target.parents if (p / ".git").exists()), None)  # its checkout
                if root is None or root.resolve() == REPO.resolve():
                    continue
                source = REPO / target.relative_to(root)
                if source.is_dir():
                    mounts.append({"kind": "bind", "source": str(source), "target": str(target), "read_only": True})
        return mounts

    @staticmethod
    def _interpreter_mounts() -> list[dict]:
        """The venv's base interpreter (the image's /usr/local python), where uid 10001 can reach it:
        under a home (e.g. pyenv's /root/.pyenv) only root may enter, a tmpfs over that home first."""
        prefix, staged = Path(sys.base_prefix), "/opt/.python-base"
        for parent in reversed(prefix.parents):
            if parent != Path("/") and not os.stat(parent).st_mode & 0o001:
                return [{"kind": "bind", "source": str(prefix), "target": staged, "read_only": True},
                        {"kind": "tmpfs", "target": str(parent), "options": "mode=0755,size=1m"},
                        {"kind": "bind", "source": staged, "target": str(prefix), "read_only": True}]  # fmt: skip
        return []

    def hosts_path(self) -> Path:
        return self.base / "hosts"

    # -- pods --------------------------------------------------------------------------------------
    def start(self, pod: str):
        return self.pods.start(self.plans[pod], self.shared)

    @property
    def shared(self) -> Path:
        path = self.base / "shared"  # the joynexus-shared PVC (EFS)
        if not path.exists():
            path.mkdir()
            os.chown(path, 10001, 10001)
        return path

    def close(self) -> None:
        for close in reversed(self.closers):
            try:
                close()
            except Exception as error:  # noqa: BLE001 - teardown goes on
                print(f"topology teardown: {error}", file=sys.stderr)
