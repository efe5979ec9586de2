"""SFT through the upper layer of the JoyNexus API: declare the work, let the Master Service run it.

The tenant's spec names its dataset; `submit` runs SFT jobs on the shared backbone, the handle
follows the workload (Server-Sent Events), and the trained version is checkpointed, registered and
served — then this script asks the Inference Queue for actions and prints the tenant's usage.

    joynexus serve --services in-process            # prints the admin key at its first start
    export JOYNEXUS_ADMIN_KEY=<admin key>
    python examples/sft_upper_layer.py --demo       # writes a small LeRobot dataset, creates a tenant, trains

With your own tenant (created from a spec with `joynexus tenant create spec.yaml`):

    JOYNEXUS_API_KEY=<tenant key> python examples/sft_upper_layer.py --jobs 4
"""

from __future__ import annotations

import argparse
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from joynexus.client import JoyNexusClient


def demo_spec(tenant: str, dataset_root: Path, base_model: str = "joynexus/tiny-smolvlm", jobs: int = 4) -> dict:
    """A small SFT tenant: one camera, 32x32 images, 4-d state, 2-step chunks of 3-d actions."""
    return {
        "tenant": tenant,
        "base_model": base_model,
        "task": "sft",
        "action_module": {"kind": "oft_mlp", "size": "tiny"},
        "observation": {
            "cameras": ["front"],
            "image_size": [32, 32],
            "state_dim": 4,
            "action_dim": 3,
            "action_chunk": 2,
            "instruction": "pick up the cube",
        },
        "dataset": {"root": str(dataset_root), "repo_id": "examples/sft"},
        "scheduling": {"completion_target": jobs},
        "training": {"samples_per_job": 16, "microbatch_size": 8, "learning_rate": 3e-3},
    }


def write_demo_dataset(root: Path) -> Path:
    """A synthetic LeRobot dataset (image mode) for `demo_spec`, on the server's disk."""
    from joynexus.data.lerobot_dataset import write_synthetic_dataset

    if not (root / "meta" / "info.json").exists():
        write_synthetic_dataset(
            root,
            "examples/sft",
            cameras=["front"],
            image_size=(32, 32),
            state_dim=4,
            action_dim=3,
            num_episodes=2,
            episode_length=16,
            task="pick up the cube",
            seed=0,
        )
    return root


def run(
    url: str | None = None,
    api_key: str | None = None,
    *,
    jobs: int = 4,
    admin_key: str | None = None,
    spec: dict[str, Any] | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Create the tenant from `spec` when an admin key is given, train `jobs` SFT jobs, predict."""
    if spec is not None:
        with JoyNexusClient(url, admin_key) as admin:
            created = admin.create_tenant(spec)
        api_key = created.key.api_key
        log(f"created tenant {created.tenant.tenant_id} (schema {created.tenant.schema_signature})")
    with JoyNexusClient(url, api_key) as client:
        tenant = client.tenant()
        handle = client.submit(jobs=jobs)
        log(f"workload {handle.workload_id}: {handle.submitted.state}")
        for event in handle.events():
            extra = event.model_dump()
            if event.kind == "job_completed":
                log(f"  job {extra['completed_jobs']}/{extra['target_jobs']} done, version {extra['version']}")
            elif event.kind == "step":
                log(f"  step {extra['step']}: loss {extra['loss']:.4f}")
        final = handle.result(timeout=600)
        log(f"workload {final.workload_id}: {final.state}, version {final.version}, last loss {final.last_loss:.4f}")

        versions = client.versions()
        log(f"checkpoints {[c.version for c in versions.checkpoints]}, served {versions.serving_versions}")
        payload = client.export(final.version)
        log(f"exported version {final.version}: {len(payload):,} bytes of safetensors (action module only)")

        height, width = tenant.image_size
        images = np.random.default_rng(0).random((2, len(tenant.cameras), 3, height, width), dtype=np.float32)
        state = np.zeros((2, tenant.state_dim), dtype=np.float32)
        prediction = client.predict(images, state)
        actions = prediction.actions.to_numpy()
        log(f"actions {actions.shape} from version {prediction.policy_version}")

        usage = client.usage()
        log(
            f"usage: {usage.device_seconds.training:.2f} training + {usage.device_seconds.inference:.3f} inference "
            f"device-seconds, {usage.samples_trained} samples trained, {usage.storage_bytes:,} bytes stored"
        )
        return {"workload": final, "versions": versions, "actions": actions, "usage": usage, "payload": payload}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=None, help="API URL [env JOYNEXUS_URL, default http://127.0.0.1:8765]")
    parser.add_argument("--jobs", type=int, default=4)
    parser.add_argument("--demo", action="store_true", help="write a demo dataset and create a tenant (admin key)")
    parser.add_argument("--data-dir", type=Path, default=Path("var/examples"), help="where --demo writes its dataset")
    args = parser.parse_args()
    spec = None
    if args.demo:
        import os

        root = write_demo_dataset((args.data_dir / "sft-dataset").resolve())
        spec = demo_spec(f"example-sft-{uuid.uuid4().hex[:6]}", root, jobs=args.jobs)
        run(args.url, jobs=args.jobs, admin_key=os.environ.get("JOYNEXUS_ADMIN_KEY"), spec=spec)
    else:
        run(args.url, jobs=args.jobs)


if __name__ == "__main__":
    main()
