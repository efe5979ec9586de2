"""The container runtime of the topology test (tests/deploy/test_topology.py), as small as it can be:
started as root with a JSON pod description, it joins the pod's network namespace, gives the process
a mount namespace of its own (the pod's volumes, /etc/hosts, the image paths, a read-only root when
the manifest asks), enters the pod's memory (and cpu) cgroups, sets the pod's hostname, drops to the manifest's
uid/gid with no new privileges, and execs the container's command with exactly its environment.
No shell anywhere: argv goes to execvpe as a list.

    python tests/deploy/podexec.py POD.json
"""

from __future__ import annotations

import ctypes
import json
import os
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 32, 4096, 16384, 1 << 18
PR_SET_NO_NEW_PRIVS = 38

_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    def enc(text: str | None) -> bytes | None:
        return None if text is None else text.encode()

    _check(_libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)), f"mount {target}")


def _bind(source: str, target: str, read_only: bool) -> None:
    _mount(source, target, None, MS_BIND | MS_REC)
    if read_only:
        _mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def enter(pod: dict) -> None:
    """Everything between fork and exec, in the order a container runtime does it."""
    for cgroup in pod["cgroups"]:
        with open(cgroup + "/cgroup.procs", "w") as procs:
            procs.write(str(os.getpid()))
    fd = os.open(pod["netns"], os.O_RDONLY)
    _check(_libc.setns(fd, CLONE_NEWNET), "setns")
    os.close(fd)
    _check(_libc.unshare(CLONE_NEWNS | CLONE_NEWUTS), "unshare")
    name = pod["hostname"].encode()
    _check(_libc.sethostname(name, len(name)), "sethostname")
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    for m in pod["mounts"]:
        if not os.path.lexists(m["target"]):
            os.makedirs(m["target"])  # inside a tmpfs mounted before (the image's paths)
        if m["kind"] == "tmpfs":
            _mount("tmpfs", m["target"], "tmpfs", MS_NOSUID | MS_NODEV, m.get("options"))
            if "owner" in m:
                os.chown(m["target"], *m["owner"])
        else:
            _bind(m["source"], m["target"], m.get("read_only", False))
    if pod["read_only_root"]:
        _mount(None, "/", None, MS_BIND | MS_REMOUNT | MS_RDONLY)
    os.setgroups(pod["groups"])
    os.setgid(pod["gid"])
    os.setuid(pod["uid"])  # from root to non-root: every capability goes
    if pod["no_new_privs"]:
        _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
    os.chdir(pod["cwd"])


def main(argv: list[str]) -> None:
    with open(argv[1]) as f:
        pod = json.load(f)
    enter(pod)
    os.execvpe(pod["argv"][0], pod["argv"], pod["env"])


if __name__ == "__main__":
    main(sys.argv)
