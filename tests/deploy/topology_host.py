"""The host side of the topology test: a bridge with one network namespace per pod (each pod its own
address, the Service names in the pods' /etc/hosts), a memory cgroup per pod with the container's
limit (cgroup v1 here: /sys/fs/cgroup/memory; v2 if that is what the host has), the pods' volumes,
and the stand-ins for the cloud: PostgreSQL with SSL only (RDS), Redis with TLS and AUTH
(ElastiCache, the GCS store), moto's S3 server. Needs root; nothing global is changed except the
bridge, the namespaces and cgroups it removes again (the host's /etc/hosts is untouched: each pod
gets its own by a bind mount in its mount namespace)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from tests.deploy.topology_pods import PodPlan

PODEXEC = Path(__file__).with_name("podexec.py")
PG_BIN = Path("/usr/lib/postgresql/15/bin")
SYSTEM_CA = Path("/etc/ssl/certs/ca-certificates.crt")


def sh(*argv: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
    done = subprocess.run(list(argv), capture_output=True, text=True, **kw)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip() or done.stdout.strip()}")
    return done


class Network:
    """A bridge `jnx<run>` at <subnet>.1 and a namespace per pod at <subnet>.<10+i>."""

    def __init__(self, run: str, subnet: str):
        self.run, self.subnet = run, subnet
        self.bridge = f"jnxb{run}"
        self.gateway = f"{subnet}.1"
        self.namespaces: list[str] = []
        sh("ip", "link", "add", self.bridge, "type", "bridge")
        sh("ip", "addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        sh("ip", "link", "set", self.bridge, "up")

    def add_pod(self, index: int) -> tuple[str, str]:
        ns, host_if, ip = f"jnx{self.run}-{index}", f"jnxh{self.run}{index}", f"{self.subnet}.{10 + index}"
        sh("ip", "netns", "add", ns)
        self.namespaces.append(ns)
        sh("ip", "link", "add", host_if, "type", "veth", "peer", "name", "eth0", "netns", ns)
        sh("ip", "link", "set", host_if, "master", self.bridge, "up")
        for args in (("addr", "add", f"{ip}/24", "dev", "eth0"), ("link", "set", "eth0", "up"),
                     ("link", "set", "lo", "up"), ("route", "add", "default", "via", self.gateway)):  # fmt: skip
            sh("ip", "-n", ns, *args)
        return f"/run/netns/{ns}", ip

    def close(self) -> None:
        for ns in self.namespaces:
            sh("ip", "netns", "del", ns, check=False)
        sh("ip", "link", "del", self.bridge, check=False)


class MemoryCgroups:
    """A parent cgroup (its peak = the topology's peak) and one child per pod with its limit."""

    def __init__(self, run: str, cpu_requests: float):
        v1 = Path("/sys/fs/cgroup/memory")
        self.v2 = not v1.is_dir()
        self.root = (Path("/sys/fs/cgroup") if self.v2 else v1) / f"joynexus-topology-{run}"
        self.root.mkdir()
        # CPU weight as the kubelet gives it (cpu.shares = requested milli-CPU x 1024 / 1000), for
        # the whole topology too: on a host shared with other work, its pods still get about what
        # they request. v1 only (v2: cpu.weight would need the same arithmetic; left at default).
        self.cpu_root = None if self.v2 else Path("/sys/fs/cgroup/cpu") / f"joynexus-topology-{run}"
        if self.v2:
            (self.root / "cgroup.subtree_control").write_text("+memory")
        else:
            (self.root / "memory.use_hierarchy").write_text("1")
            self.cpu_root.mkdir()
            (self.cpu_root / "cpu.shares").write_text(str(max(2, int(cpu_requests * 1024))))

    def add(self, pod: str, limit: int, cpu_request: float) -> list[str]:
        path = self.root / pod
        path.mkdir()
        (path / ("memory.max" if self.v2 else "memory.limit_in_bytes")).write_text(str(limit))
        if self.cpu_root is None:
            return [str(path)]
        (self.cpu_root / pod).mkdir()
        (self.cpu_root / pod / "cpu.shares").write_text(str(max(2, int(cpu_request * 1024))))
        return [str(path), str(self.cpu_root / pod)]

    def peak(self, pod: str | None = None) -> int:
        path = self.root / pod if pod else self.root
        name = "memory.peak" if self.v2 else "memory.max_usage_in_bytes"
        return int((path / name).read_text()) if (path / name).exists() else 0

    def oom_kills(self, pod: str) -> int:
        if self.v2:
            events = dict(line.split() for line in (self.root / pod / "memory.events").read_text().splitlines())
            return int(events.get("oom_kill", 0))
        control = dict(line.split() for line in (self.root / pod / "memory.oom_control").read_text().splitlines())
        return int(control.get("oom_kill", 0))

    def pids(self, pod: str) -> list[int]:
        path = self.root / pod / "cgroup.procs"
        return [int(p) for p in path.read_text().split()] if path.exists() else []

    def kill(self, pod: str, timeout_s: float = 20.0) -> None:
        deadline = time.monotonic() + timeout_s
        while (pids := self.pids(pod)) and time.monotonic() < deadline:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.2)

    def close(self) -> None:
        for child in [p for p in self.root.iterdir() if p.is_dir()]:
            self.kill(child.name)
            child.rmdir()
        self.root.rmdir()
        if self.cpu_root is not None:
            for child in [p for p in self.cpu_root.iterdir() if p.is_dir()]:
                child.rmdir()
            self.cpu_root.rmdir()


def self_signed(directory: Path, names: list[str]) -> tuple[Path, Path]:
    cert, key = directory / "server.crt", directory / "server.key"
    sans = ",".join(f"DNS:{n}" for n in names)
    sh("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", f"/CN={names[0]}",
       "-addext", f"subjectAltName={sans}", "-keyout", str(key), "-out", str(cert))  # fmt: skip
    return cert, key


def trust_store(directory: Path, ca: Path) -> Path:
    """A copy of the system's /etc/ssl/certs with `ca` added as update-ca-certificates would: in the
    bundle and as a hashed link (OpenSSL / BoringSSL look up either)."""
    shutil.copytree(SYSTEM_CA.parent, directory, symlinks=True)
    shutil.copy(ca, directory / "joynexus-topology-ca.pem")
    digest = sh("openssl", "x509", "-hash", "-noout", "-in", str(ca)).stdout.strip()
    (directory / f"{digest}.0").symlink_to("joynexus-topology-ca.pem")
    bundle = directory / SYSTEM_CA.name
    bundle.unlink()
    bundle.write_text(SYSTEM_CA.read_text() + ca.read_text())
    return directory


def start_postgres(base: Path, listen: str, cert: Path, key: Path, password: str) -> Path:
    """A PostgreSQL cluster of its own (the host's one has no SSL): TCP only with SSL (hostnossl
    rejected), scram passwords; the unix socket (trust, for the test's own setup) in `base`."""
    data = base / "pgdata"
    base.mkdir(parents=True, exist_ok=True)
    shutil.copy(cert, base / "server.crt")
    shutil.copy(key, base / "server.key")
    (base / "pwfile").write_text(password + "\n")
    shutil.chown(base, "postgres", "postgres")
    for name in ("server.crt", "server.key", "pwfile"):
        shutil.chown(base / name, "postgres", "postgres")
        (base / name).chmod(0o600)
    sh("runuser", "-u", "postgres", "--", str(PG_BIN / "initdb"), "-D", str(data), "-U", "postgres",
       f"--pwfile={base / 'pwfile'}", "--auth-local=trust", "--auth-host=scram-sha-256")  # fmt: skip
    (data / "pg_hba.conf").write_text(
        "local all all trust\nhostssl all all 0.0.0.0/0 scram-sha-256\nhostnossl all all 0.0.0.0/0 reject\n"
    )
    with open(data / "postgresql.conf", "a") as conf:
        conf.write(f"listen_addresses = '{listen}'\nport = 5432\nunix_socket_directories = '{base}'\n"
                   f"ssl = on\nssl_cert_file = '{base / 'server.crt'}'\nssl_key_file = '{base / 'server.key'}'\n"
                   "max_connections = 300\nshared_buffers = 64MB\nfsync = off\n")  # fmt: skip
    sh(
        "runuser",
        "-u",
        "postgres",
        "--",
        str(PG_BIN / "pg_ctl"),
        "-D",
        str(data),
        "-l",
        str(base / "log"),
        "-w",
        "start",
    )
    return data


def stop_postgres(data: Path) -> None:
    sh(
        "runuser",
        "-u",
        "postgres",
        "--",
        str(PG_BIN / "pg_ctl"),
        "-D",
        str(data),
        "-m",
        "immediate",
        "stop",
        check=False,
    )


def psql(base: Path, sql: str, db: str = "postgres") -> str:
    return sh("psql", "-h", str(base), "-U", "postgres", "-d", db, "-Atc", sql).stdout


class Pods:
    """Pods as processes: `podexec.py` per pod, its log in <base>/logs/<pod>.log."""

    def __init__(self, base: Path, network: Network, cgroups: MemoryCgroups, common_mounts: list[dict]):
        self.base, self.network, self.cgroups, self.common_mounts = base, network, cgroups, common_mounts
        self.ips: dict[str, str] = {}
        self.netns: dict[str, str] = {}
        self.plans: dict[str, PodPlan] = {}
        self.procs: dict[str, subprocess.Popen] = {}
        self.exits: dict[str, list[int]] = {}  # each container exit's code, per pod
        self.succeeded: set[str] = set()  # Jobs that completed
        self.cgroup_paths: dict[str, list[str]] = {}
        self.shared: Path | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        (base / "logs").mkdir(parents=True, exist_ok=True)
        self._kubelet = threading.Thread(target=self._supervise, name="topology-kubelet", daemon=True)
        self._kubelet.start()

    def _supervise(self) -> None:
        """The kubelet's restart policy: Always (Deployments, Ray pods) restarts a container that
        exits; OnFailure (Jobs) restarts one that fails, up to the Job's backoffLimit. Back-off
        5 s doubling to 60 s. A container that exits takes the rest of its cgroup with it."""
        pending: dict[str, float] = {}
        while not self._stop.wait(0.5):
            with self._lock:
                for pod, proc in list(self.procs.items()):
                    code = proc.poll()
                    if code is None or pod in pending or pod in self.succeeded:
                        continue
                    self.cgroups.kill(pod)
                    plan = self.plans[pod]
                    self.exits.setdefault(pod, []).append(code)
                    failures = sum(1 for c in self.exits[pod] if c != 0)
                    if plan.restart == "OnFailure" and code == 0:
                        self.succeeded.add(pod)
                    elif plan.restart == "Always" or (plan.restart == "OnFailure" and failures <= plan.backoff_limit):
                        pending[pod] = time.monotonic() + min(60.0, 5.0 * 2 ** (len(self.exits[pod]) - 1))
                for pod, when in list(pending.items()):
                    if time.monotonic() >= when:
                        del pending[pod]
                        self._spawn(self.plans[pod])

    def address(self, pod: str) -> str:
        if pod not in self.ips:
            self.netns[pod], self.ips[pod] = self.network.add_pod(len(self.ips))
        return self.ips[pod]

    def _mounts(self, plan: PodPlan, shared: Path) -> list[dict]:
        mounts = list(self.common_mounts)
        for volume in plan.volumes:
            if volume["kind"] == "memory":
                size = volume["size"] or "64m"
                mounts.append(
                    {"kind": "tmpfs", "target": volume["target"], "options": f"size={size.replace('i', '')},mode=1777"}
                )
                continue
            source = shared if volume["kind"] == "pvc" else self.base / "volumes" / plan.name / volume["name"]
            source.mkdir(parents=True, exist_ok=True)
            if volume["kind"] in ("secret", "configMap"):  # the kubelet's: one read-only file per key
                for name, value in volume["files"].items():
                    path = source / name
                    path.write_text(value)
                    os.chown(path, plan.uid, plan.groups[-1])
                    path.chmod(0o400 if volume["kind"] == "secret" else 0o444)
            elif volume["kind"] != "pvc":
                os.chown(source, plan.uid, plan.groups[-1])
                source.chmod(0o2777)  # emptyDir: world-writable, fsGroup-owned
            mounts.append(
                {"kind": "bind", "source": str(source), "target": volume["target"], "read_only": volume["read_only"]}
            )
        for m in mounts:
            if not Path(m["target"]).exists():
                Path(m["target"]).mkdir(parents=True)  # a path the image has: an empty mount point here
        return mounts

    def start(self, plan: PodPlan, shared: Path) -> None:
        self.shared = shared
        self.address(plan.name)
        with self._lock:
            if plan.name not in self.plans:
                self.cgroup_paths[plan.name] = self.cgroups.add(plan.name, plan.memory_limit, plan.cpu_request)
            self.plans[plan.name] = plan
            self._spawn(plan)

    def recreate(self, pod: str) -> None:
        """The pod deleted and made anew by its controller (same name and address): its containers
        killed, its emptyDirs gone, then started again."""
        with self._lock:
            self.cgroups.kill(pod)
            self.procs[pod].wait(timeout=30)
            self.exits.setdefault(pod, []).append(self.procs[pod].returncode)
            shutil.rmtree(self.base / "volumes" / pod, ignore_errors=True)
            self._spawn(self.plans[pod])

    def _spawn(self, plan: PodPlan) -> None:
        shared = self.shared
        spec = {"netns": self.netns[plan.name], "cgroups": self.cgroup_paths[plan.name], "hostname": plan.name,
                "mounts": self._mounts(plan, shared), "read_only_root": plan.read_only_root, "uid": plan.uid,
                "gid": plan.gid, "groups": plan.groups, "no_new_privs": plan.no_new_privs, "cwd": plan.cwd,
                "argv": plan.argv, "env": plan.env}  # fmt: skip
        spec_file = self.base / "specs" / f"{plan.name}.json"
        spec_file.parent.mkdir(exist_ok=True)
        spec_file.write_text(json.dumps(spec, indent=1))
        log = open(self.base / "logs" / f"{plan.name}.log", "ab")
        proc = subprocess.Popen([sys.executable, str(PODEXEC), str(spec_file)], stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
        self.procs[plan.name] = proc

    def log(self, pod: str, tail: int = 4000) -> str:
        path = self.base / "logs" / f"{pod}.log"
        return path.read_text(errors="replace")[-tail:] if path.exists() else ""

    def wait_job(self, pod: str, timeout_s: float) -> None:
        """Until the Job's pod succeeded; fails when its backoffLimit is spent or time is up."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if pod in self.succeeded:
                    return
                exits = self.exits.get(pod, [])
                if sum(1 for c in exits if c != 0) > self.plans[pod].backoff_limit:
                    raise AssertionError(f"Job {pod} failed {len(exits)} times {exits}:\n{self.log(pod)}")
            time.sleep(1.0)
        raise AssertionError(
            f"Job {pod} not complete after {timeout_s:.0f}s (exits {self.exits.get(pod)}):\n{self.log(pod)}"
        )

    def wait_http(self, pod: str, timeout_s: float) -> float:
        """Until the pod's startup/readiness probe (httpGet) answers 2xx/3xx; the seconds it took."""
        plan, start = self.plans[pod], time.monotonic()
        port = plan.probe["port"]
        port = plan.ports.get(port, port) if isinstance(port, str) else port
        url = f"http://{self.ips[pod]}:{port}{plan.probe['path']}"
        while time.monotonic() - start < timeout_s:
            try:
                with urllib.request.urlopen(url, timeout=5) as response:
                    if response.status < 400:
                        return time.monotonic() - start
            except OSError:
                pass
            time.sleep(1.0)
        raise AssertionError(f"{pod}: {url} did not answer in {timeout_s:.0f}s:\n{self.log(pod)}")

    def close(self) -> None:
        self._stop.set()
        self._kubelet.join(timeout=10)
        for pod in list(self.procs):
            self.cgroups.kill(pod)
            self.procs[pod].wait(timeout=30)


class ClusterDns:
    """The cluster DNS (kube-dns) stand-in: A records for the Service names on the gateway's port 53,
    NXDOMAIN for the rest. gRPC (Ray's GCS clients) resolves through c-ares, which asks DNS and not
    /etc/hosts, so the pods' resolv.conf names this server as a Kubernetes pod's names kube-dns."""

    def __init__(self, address: str, records: dict[str, str]):
        import socket

        self.records = {name.lower().rstrip("."): ip for name, ip in records.items()}
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind((address, 53))
        self.sock.settimeout(0.5)
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, name="topology-dns", daemon=True)
        self.thread.start()

    def _answer(self, query: bytes) -> bytes:
        import struct

        labels, i = [], 12
        while query[i]:
            labels.append(query[i + 1 : i + 1 + query[i]].decode(errors="replace"))
            i += query[i] + 1
        qtype = struct.unpack(">H", query[i + 1 : i + 3])[0]
        question = query[12 : i + 5]
        ip = self.records.get(".".join(labels).lower())
        flags = 0x8580 if ip else 0x8583  # response, authoritative, recursion desired/available; rcode
        answers = b""
        if ip and qtype == 1:
            answers = b"\xc0\x0c" + struct.pack(">HHIH", 1, 1, 30, 4) + bytes(int(p) for p in ip.split("."))
        header = query[:2] + struct.pack(">HHHHH", flags, 1, 1 if answers else 0, 0, 0)
        return header + question + answers

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                query, peer = self.sock.recvfrom(512)
                self.sock.sendto(self._answer(query), peer)
            except OSError:
                continue
            except Exception:  # noqa: BLE001 - a malformed query gets no answer
                continue

    def close(self) -> None:
        self._stop.set()
        self.thread.join(timeout=5)
        self.sock.close()
