"""The process tests/master/test_chaos.py kills: a whole deployment in one process (SQLite store,
local checkpoints, Training Model Service, Master Service) that creates the tenants it is given,
submits their workloads and reports progress on stdout as JSON lines until it is killed.

    python -m tests.master.chaos_worker <plan.json>

The plan holds `data_dir`, `specs` (tenant specs, datasets already written) and `workloads`
(a list of [tenant_id, jobs], submitted in that order). Lines printed:
  {"event": "submitted", "workloads": [{"workload_id", "tenant_id", "state", "position"}, ...]}
  {"event": "export", "tenant_id", "version", "weights"}   (the weights of every version it saw)
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any


def weights_digest(tensors: dict[str, Any]) -> str:
    """sha256 over a module state (names, dtypes, shapes, bytes): the identity of a set of weights."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name].detach().cpu().contiguous()
        h.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        h.update(tensor.numpy().tobytes())
    return h.hexdigest()


def export_digest(training: Any, tenant_id: str) -> tuple[int, str]:
    """(version, weights digest) of what the Training Model Service exports for the tenant now."""
    from joynexus.artifacts import decode_tenant_payload

    tensors, manifest = decode_tenant_payload(training.export_params(tenant_id))
    return manifest.policy_version, weights_digest(tensors)


def say(**data: Any) -> None:
    print(json.dumps(data), flush=True)


def main(plan_path: str) -> None:
    from joynexus.connect import in_process
    from joynexus.settings import Settings

    plan = json.loads(Path(plan_path).read_text())
    cluster = in_process(Settings(data_dir=Path(plan["data_dir"]), torch_threads=1))
    master = cluster.master
    for spec in plan["specs"]:
        master.create_tenant(spec)
    submitted = [master.submit_workload(tenant_id, jobs=jobs) for tenant_id, jobs in plan["workloads"]]
    say(event="submitted", workloads=[s.model_dump(include={"workload_id", "tenant_id", "state", "position"})
                                      for s in submitted])  # fmt: skip
    tenants = sorted({tenant_id for tenant_id, _ in plan["workloads"]})
    seen: dict[str, int] = {}
    while True:  # until killed
        for tenant_id in tenants:
            version, digest = export_digest(cluster.training, tenant_id)
            if seen.get(tenant_id) != version:
                seen[tenant_id] = version
                say(event="export", tenant_id=tenant_id, version=version, weights=digest)
        time.sleep(0.005)


if __name__ == "__main__":
    main(sys.argv[1])
