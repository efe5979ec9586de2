"""A custom algorithm composed from the lower layer: REINFORCE on gym-pusht.

Nothing here is a JoyNexus workload: the script owns the loop and calls the core primitives of
the paper's Fig. 4 on its own tenant —

    reset / step          environment sessions (the Environment Service, one worker process each)
    predict(sample=True)  actions from the tenant's Gaussian policy, through the shared Inference Queue
    forward_backward      -mean(advantage * log pi(action | obs)), gradients summed on the tenant's slot
    optim_step            clip + AdamW on the tenant's slot only; a new policy version
    load_weights          serve the new version for the next round of episodes

The tenant is an RL tenant (its action module is a stochastic policy) whose declared environment is
gym-pusht; `--create` makes one with the admin key.

    joynexus serve --services in-process
    JOYNEXUS_ADMIN_KEY=<admin key> python examples/custom_reinforce.py --create
    JOYNEXUS_API_KEY=<rl tenant key> python examples/custom_reinforce.py --iterations 10
"""

from __future__ import annotations

import argparse
import os
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np

from joynexus.client import JoyNexusClient


def pusht_rl_spec(tenant: str, base_model: str = "joynexus/tiny-smolvlm") -> dict[str, Any]:
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
            "instruction": "push the T-shaped block onto the target",
        },
        "environment": {"simulator": "pusht", "task": "PushT-v0", "max_episode_steps": 64},
        "training": {"learning_rate": 3e-3},
    }


def reward_to_go(rewards: list[float], gamma: float) -> list[float]:
    out, running = [], 0.0
    for reward in reversed(rewards):
        running = reward + gamma * running
        out.append(running)
    return out[::-1]


def run(
    url: str | None = None,
    api_key: str | None = None,
    *,
    iterations: int = 3,
    episodes: int = 2,
    horizon: int = 16,
    gamma: float = 0.99,
    microbatch: int = 16,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    with JoyNexusClient(url, api_key) as client:
        tenant = client.tenant()
        if not tenant.stochastic or tenant.environment is None:
            raise SystemExit(f"tenant {tenant.tenant_id!r} needs a stochastic policy and an environment (an RL tenant)")
        session = client.open_session({**tenant.environment, "max_episode_steps": horizon})
        low = np.asarray(session.spec["action_low"], dtype=np.float32)
        high = np.asarray(session.spec["action_high"], dtype=np.float32)
        history = []
        try:
            for iteration in range(iterations):
                served = client.load_weights()  # the episodes below act with exactly this version
                images, states, actions, returns, episode_returns = [], [], [], [], []
                for episode in range(episodes):
                    obs = client.reset(session.session_id, seed=iteration * episodes + episode)
                    rewards = []
                    for _ in range(horizon):
                        image = np.stack([obs["images"][camera] for camera in tenant.cameras])
                        state = np.asarray(obs["state"], dtype=np.float32)
                        chunk = client.predict(image[None], state[None], sample=True).actions.to_numpy()[0]
                        # the policy acts in [-1, 1]; the simulator takes targets in [low, high]
                        target = low + (np.clip(chunk[0], -1.0, 1.0) + 1.0) / 2.0 * (high - low)
                        result = client.step(session.session_id, target)
                        images.append(image)
                        states.append(state)
                        actions.append(chunk)
                        rewards.append(float(result["reward"]))
                        obs = result["observation"]
                        if result["terminated"] or result["truncated"]:
                            break
                    returns += reward_to_go(rewards, gamma)
                    episode_returns.append(sum(rewards))
                advantages = np.asarray(returns, dtype=np.float32)
                advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-6)
                # gradients of every microbatch are summed on the slot; one optimizer step applies them
                for start in range(0, len(advantages), microbatch):
                    rows = slice(start, start + microbatch)
                    client.forward_backward(
                        np.stack(images[rows]),
                        np.stack(states[rows]),
                        np.stack(actions[rows]),
                        loss="policy_gradient",
                        advantages=advantages[rows],
                    )
                step = client.optim_step()
                mean_return = float(np.mean(episode_returns))
                history.append({"version": step.version, "mean_return": mean_return, "samples": step.samples})
                log(
                    f"iteration {iteration}: served v{served.version}, mean return {mean_return:.3f}, "
                    f"{step.samples} samples, policy-gradient loss {step.loss:.4f} -> v{step.version}"
                )
        finally:
            client.close_session(session.session_id)
        usage = client.usage()
        log(f"env steps {usage.env_steps}, device-seconds {usage.device_seconds.total:.2f}")
        return {"history": history, "usage": usage}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=None, help="API URL [env JOYNEXUS_URL, default http://127.0.0.1:8765]")
    parser.add_argument("--create", action="store_true", help="create an RL tenant first (env JOYNEXUS_ADMIN_KEY)")
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--episodes", type=int, default=2)
    parser.add_argument("--horizon", type=int, default=16)
    args = parser.parse_args()
    api_key = None
    if args.create:
        with JoyNexusClient(args.url, os.environ.get("JOYNEXUS_ADMIN_KEY")) as admin:
            created = admin.create_tenant(pusht_rl_spec(f"example-rl-{uuid.uuid4().hex[:6]}"))
        api_key = created.key.api_key
        print(f"created RL tenant {created.tenant.tenant_id}; its key: {api_key}")
    run(args.url, api_key, iterations=args.iterations, episodes=args.episodes, horizon=args.horizon)


if __name__ == "__main__":
    main()
