"""A pipelined custom training loop on the lower layer: futures, sampling, an importance-sampled
policy gradient — and the same loop blocking, timed side by side (issue 28).

Each iteration draws `n` action chunks per observation from the tenant's current training policy
(`sample`, with their log-probabilities), scores them on the client (a reward: how close each chunk
is to a target that depends on the state; `--client-work-ms` stands for a simulator or a reward
model), and takes one policy-gradient step with group-normalized advantages.

Pipelined: the next batch's `sample_async` is queued BEFORE this batch's step, and its
`compute_logprobs_async` right after the step, so while the client scores a batch the server runs
the previous step, these log-probabilities and the next draw; the client waits only when the server
is behind. The next batch is therefore drawn one version behind the policy it trains: the loss is
importance-sampled, ratio = pi_current / pi_behavior from `compute_logprobs_async` (queued after the
step, so it sees the new version; a tenant's calls run in submission order), clipped to [0, 2], and
the step's advantages are ratio * advantage (the gradient of -mean(ratio * A) with the ratio's own
gradient, exactly: d ratio = ratio * d log pi). The IS / PPO-clip losses of issue 28.4 are not used
here: `policy_gradient` with ratio-weighted advantages is the same IS estimator.

Blocking: sample, score, compute_logprobs, forward_backward, optim_step, one after another (on
policy: its ratios are 1).

    joynexus serve --services in-process
    JOYNEXUS_ADMIN_KEY=<admin key> python examples/pipelined_loop.py --create
    JOYNEXUS_API_KEY=<rl tenant key> python examples/pipelined_loop.py --iterations 20
"""

from __future__ import annotations

import argparse
import os
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np

from joynexus.client import JoyNexusClient


def rl_spec(tenant: str, base_model: str = "joynexus/tiny-smolvlm") -> dict[str, Any]:
    """An RL tenant (a Gaussian policy head) whose declared environment is gym-pusht."""
    return {
        "tenant": tenant,
        "base_model": base_model,
        "task": "rl",
        "action_module": {"kind": "oft_mlp", "size": "tiny"},
        "observation": {
            "cameras": ["top"],
            "image_size": [32, 32],
            "state_dim": 2,
            "action_dim": 2,
            "action_chunk": 2,
            "instruction": "push the T-shaped block onto the target",
        },
        "environment": {"simulator": "pusht", "task": "PushT-v0", "max_episode_steps": 64},
        "training": {"learning_rate": 3e-3},
    }


class Batches:
    """Observations of the tenant's schema (fixed per index, so both loops see the same data)."""

    def __init__(self, tenant: Any, size: int) -> None:
        self.cameras, (self.height, self.width) = len(tenant.cameras), tenant.image_size
        self.state_dim, self.size = tenant.state_dim, size

    def __call__(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng(index)
        images = rng.random((self.size, self.cameras, 3, self.height, self.width), dtype=np.float32)
        return images, rng.uniform(-1, 1, (self.size, self.state_dim)).astype(np.float32)


def score(state: np.ndarray, actions: np.ndarray, client_work_s: float) -> np.ndarray:
    """Group-normalized advantages of (B, n, chunk, dim) chunks: reward = -|chunk - target(state)|^2."""
    if client_work_s:
        time.sleep(client_work_s)  # a simulator or reward model would run here
    target = np.tanh(state)[:, None, None, : actions.shape[-1]]
    rewards = -((actions - target) ** 2).sum(axis=(-1, -2))
    return (rewards - rewards.mean(axis=1, keepdims=True)) / (rewards.std(axis=1, keepdims=True) + 1e-6)


def _flat(images: np.ndarray, state: np.ndarray, actions: np.ndarray) -> tuple[np.ndarray, ...]:
    """Each observation repeated once per drawn chunk, with the chunks: (B * n, ...) rows."""
    n = actions.shape[1]
    return np.repeat(images, n, axis=0), np.repeat(state, n, axis=0), actions.reshape(-1, *actions.shape[2:])


def blocking_loop(client: JoyNexusClient, batches: Batches, iterations: int, n: int, work_s: float) -> list[dict]:
    history = []
    for i in range(iterations):
        images, state = batches(i)
        drawn = client.sample(images, state, n=n, seed=i)
        actions = drawn.actions.to_numpy()
        advantages = score(state, actions, work_s).reshape(-1)
        rows = _flat(images, state, actions)
        current = client.compute_logprobs(*rows).log_probs.to_numpy()
        ratio = np.clip(np.exp(current - drawn.log_probs.to_numpy().reshape(-1)), 0.0, 2.0)
        client.forward_backward(*rows, loss="policy_gradient", advantages=(ratio * advantages).astype(np.float32))
        step = client.optim_step()
        history.append({"version": step.version, "loss": step.loss, "ratio_mean": float(ratio.mean())})
    return history


def pipelined_loop(client: JoyNexusClient, batches: Batches, iterations: int, n: int, work_s: float) -> list[dict]:
    history, steps = [], []
    images, state = batches(0)
    drawn = client.sample(images, state, n=n, seed=0)
    current = client.compute_logprobs_async(*_flat(images, state, drawn.actions.to_numpy()))
    for i in range(iterations):
        actions, behavior = drawn.actions.to_numpy(), drawn.log_probs.to_numpy().reshape(-1)
        if i + 1 < iterations:  # queued before this step: drawn by the policy this batch trains
            next_images, next_state = batches(i + 1)
            drawing = client.sample_async(next_images, next_state, n=n, seed=i + 1)
        # Scored while the server runs what is queued (the last step, these log-probs, the next draw).
        advantages = score(state, actions, work_s).reshape(-1)
        ratio = np.clip(np.exp(current.result(timeout=120).log_probs.to_numpy() - behavior), 0.0, 2.0)
        rows = _flat(images, state, actions)
        client.forward_backward_async(*rows, loss="policy_gradient", advantages=(ratio * advantages).astype(np.float32))
        steps.append((client.optim_step_async(), float(ratio.mean())))
        if i + 1 < iterations:
            images, state, drawn = next_images, next_state, drawing.result(timeout=120)
            # Queued after the step: the next batch's log-probs under the policy it will train.
            current = client.compute_logprobs_async(*_flat(images, state, drawn.actions.to_numpy()))
    for step, ratio_mean in steps:  # collected at the end: nothing above waited for a step
        result = step.result(timeout=120)
        history.append({"version": result.version, "loss": result.loss, "ratio_mean": ratio_mean})
    return history


def run(
    url: str | None = None,
    keys: tuple[str, str] | None = None,
    *,
    iterations: int = 8,
    batch: int = 4,
    n: int = 4,
    client_work_ms: float = 20.0,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Both loops, each on its own tenant (`keys`: blocking tenant's key, pipelined tenant's key),
    from the same initial policy seed and data: steps/s of each and their ratio."""
    if keys is None:
        first = os.environ["JOYNEXUS_API_KEY"]
        keys = (first, os.environ.get("JOYNEXUS_API_KEY_2", first))
    out: dict[str, Any] = {}
    for name, key, loop in (("blocking", keys[0], blocking_loop), ("pipelined", keys[1], pipelined_loop)):
        with JoyNexusClient(url, key) as client:
            tenant = client.tenant()
            if not tenant.stochastic:
                raise SystemExit(f"tenant {tenant.tenant_id!r} needs a stochastic policy head (an RL tenant)")
            batches = Batches(tenant, batch)
            client.sample(*batches(0), n=1, seed=0)  # warm up: first-call costs out of the timing
            started = time.perf_counter()
            history = loop(client, batches, iterations, n, client_work_ms / 1000.0)
            seconds = time.perf_counter() - started
        out[name] = {"history": history, "seconds": seconds, "steps_per_s": iterations / seconds}
        log(f"{name:>9}: {iterations} steps in {seconds:.2f} s = {iterations / seconds:.2f} steps/s")
    out["ratio"] = out["pipelined"]["steps_per_s"] / out["blocking"]["steps_per_s"]
    log(f"pipelined / blocking steps/s: {out['ratio']:.2f}x")
    return out


def create_tenants(url: str | None, admin_key: str) -> tuple[str, str]:
    """Two RL tenants (one per loop): their API keys."""
    suffix = uuid.uuid4().hex[:6]
    with JoyNexusClient(url, admin_key) as admin:
        return tuple(admin.create_tenant(rl_spec(f"pipelined-{name}-{suffix}")).key.api_key for name in ("a", "b"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=os.environ.get("JOYNEXUS_URL"))
    parser.add_argument("--create", action="store_true", help="create two RL tenants with JOYNEXUS_ADMIN_KEY")
    parser.add_argument("--iterations", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4, help="observations per step")
    parser.add_argument("--n", type=int, default=4, help="action chunks drawn per observation")
    parser.add_argument("--client-work-ms", type=float, default=20.0, help="client-side scoring time per step")
    args = parser.parse_args()
    keys = None
    if args.create:
        keys = create_tenants(args.url, os.environ["JOYNEXUS_ADMIN_KEY"])
        print(f"created two RL tenants; their keys: {keys[0]} {keys[1]}")
    run(args.url, keys, iterations=args.iterations, batch=args.batch, n=args.n, client_work_ms=args.client_work_ms)


if __name__ == "__main__":
    main()
