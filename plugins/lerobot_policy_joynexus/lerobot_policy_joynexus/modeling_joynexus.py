"""``JoyNexusPolicy``: a JoyNexus tenant version run by LeRobot (``make_policy``,
``PreTrainedPolicy.from_pretrained``, ``select_action``, ``lerobot-eval``).

The policy is the tenant's action module (its weights are this directory's ``model.safetensors``,
``action_module.*``) on the base backbone the export carries in ``backbone/`` (JoyNexus's
backbone directory format, loaded with ``BackboneSource(path=...)``; a LoRA tenant's adapter from
``adapter/`` is injected into it). The same JoyNexus code computes both, so on the same device and
dtype the actions equal what the JoyNexus Inference Model Service predicts for the version.
"""

from __future__ import annotations

import json
from collections import deque
from pathlib import Path
from typing import Any

import torch
from lerobot.policies.pretrained import PreTrainedPolicy
from lerobot.utils.constants import ACTION
from safetensors.torch import load_file

from lerobot_policy_joynexus.configuration_joynexus import JoyNexusConfig

__all__ = ["JoyNexusPolicy", "export_root"]

ACTION_MODULE_PREFIX = "action_module."
_ADAPTER_KEY = "lerobot"


def export_root(config: JoyNexusConfig) -> Path:
    """The export directory a config was loaded from (``from_pretrained`` records it)."""
    if config.pretrained_path is None:
        raise ValueError(
            "JoyNexusConfig.pretrained_path: None; a JoyNexus policy is loaded from an export directory "
            "(PreTrainedPolicy.from_pretrained(path) or --policy.path=path), it is not built from scratch"
        )
    return Path(config.pretrained_path)


def _resolve(root: Path, folder: str) -> Path:
    path = Path(folder).expanduser()
    return path if path.is_absolute() else root / path


class JoyNexusPolicy(PreTrainedPolicy):
    config_class = JoyNexusConfig
    name = "joynexus"

    def __init__(self, config: JoyNexusConfig, **kwargs: Any) -> None:
        # kwargs: make_policy passes dataset_stats / dataset_meta, which the processors use instead.
        super().__init__(config)
        from joynexus.models.action_modules import build_action_module
        from joynexus.models.backbone import BackboneSource
        from joynexus.models.placement import DevicePlacement

        config.validate_features()
        root = export_root(config)
        module_file = _resolve(root, config.action_module_dir) / "config.json"
        if not module_file.is_file():
            raise FileNotFoundError(f"action_module_dir: {str(module_file)!r} is missing from the export")
        self.action_module = build_action_module(json.loads(module_file.read_text())["action_module"])
        if self.action_module.config.action_chunk != config.chunk_size:
            raise ValueError(
                f"chunk_size: {config.chunk_size} but the action module predicts "
                f"{self.action_module.config.action_chunk} actions per call"
            )
        backbone_path = _resolve(root, config.backbone_dir)
        if not (backbone_path / "config.json").is_file():
            raise FileNotFoundError(
                f"backbone_dir: no backbone checkpoint at {str(backbone_path)!r} (export it with "
                "write_lerobot_policy, which writes the base model into the export)"
            )
        # Not a submodule: the frozen backbone has its own checkpoint and placement, and LeRobot's
        # model.safetensors holds only the tenant's weights.
        self._backbone = BackboneSource(path=str(backbone_path), preset=None).build(
            DevicePlacement(device=str(config.device or "cpu"), autocast=False)
        )
        self._adapter_key: str | None = None
        if config.adapter_dir is not None:
            self._load_adapter(_resolve(root, config.adapter_dir))
        self._queue: deque[torch.Tensor] = deque(maxlen=config.n_action_steps)

    def _load_adapter(self, folder: Path) -> None:
        """Inject the tenant's LoRA adapter (peft files of the export) under one adapter key."""
        from joynexus.artifacts.exports import EXPORT_INFO_FILE, PEFT_KEY_PREFIX, PEFT_WEIGHTS_FILE
        from joynexus.models.adapters import LoraAdapterConfig

        # The adapter's exact config is the export manifest's extra.adapter (peft's file holds the same).
        info = json.loads((export_root(self.config) / EXPORT_INFO_FILE).read_text())
        adapter = LoraAdapterConfig.model_validate(info["manifest"]["extra"]["adapter"])
        weights = load_file(str(folder / PEFT_WEIGHTS_FILE))
        state = {k.removeprefix(PEFT_KEY_PREFIX): v for k, v in weights.items()}
        self._backbone.adapters.add(_ADAPTER_KEY, adapter, state=state)
        self._adapter_key = _ADAPTER_KEY

    # -- loading ---------------------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls, pretrained_name_or_path: str | Path, *, config: JoyNexusConfig | None = None, **kwargs: Any
    ):  # type: ignore[override]
        """LeRobot's loader, with the export directory recorded in the config (the backbone and
        the action-module config are read from it). A Hub repo id is downloaded whole first."""
        root = Path(str(pretrained_name_or_path)).expanduser()
        if not root.is_dir():
            from huggingface_hub import snapshot_download

            root = Path(snapshot_download(str(pretrained_name_or_path), revision=kwargs.get("revision")))
        if config is None:
            from lerobot.configs.policies import PreTrainedConfig

            config = PreTrainedConfig.from_pretrained(root, cli_overrides=kwargs.pop("cli_overrides", []))
        config.pretrained_path = root
        return super().from_pretrained(root, config=config, **kwargs)

    @classmethod
    def _load_as_safetensor(cls, model: JoyNexusPolicy, model_file: str, map_location: str, strict: bool):
        """Only the tenant's weights live here: loaded strictly into the action module."""
        tensors = load_file(model_file, device="cpu")
        state = {
            k.removeprefix(ACTION_MODULE_PREFIX): v for k, v in tensors.items() if k.startswith(ACTION_MODULE_PREFIX)
        }
        if len(state) != len(tensors):
            raise ValueError(f"{model_file}: every tensor must be under {ACTION_MODULE_PREFIX!r}")
        model.action_module.load_state_dict(state, strict=True)
        return model.to(map_location)

    # -- LeRobot's policy interface --------------------------------------------------------
    def get_optim_params(self) -> Any:
        return self.action_module.parameters()

    def reset(self) -> None:
        self._queue.clear()

    def _features_and_state(self, batch: dict[str, Any]) -> tuple[Any, torch.Tensor]:
        cfg = self.config
        module_cfg = self.action_module.config
        device = next(self.action_module.parameters()).device
        state = batch.get(cfg.state_key)
        if module_cfg.state_dim == 0:
            n = len(batch[cfg.camera_keys[0]]) if cfg.camera_keys else 1
            state = torch.zeros(n, 0)
        elif state is None:
            raise KeyError(
                f"observation {cfg.state_key!r} is missing (the tenant takes state_dim={module_cfg.state_dim})"
            )
        state = torch.as_tensor(state, dtype=torch.float32).to(device)
        if state.dim() == 1:
            state = state.unsqueeze(0)
        n = state.shape[0]
        images: list[list[torch.Tensor]] = [[] for _ in range(n)]
        for key in cfg.camera_keys:
            frames = torch.as_tensor(batch[key], dtype=torch.float32)
            if frames.dim() == 3:
                frames = frames.unsqueeze(0)
            if frames.shape[0] != n or frames.shape[1] != 3:
                raise ValueError(
                    f"observation {key!r}: expected ({n}, 3, H, W) float in [0, 1], got {tuple(frames.shape)}"
                )
            for b in range(n):
                images[b].append(frames[b])
        # A blank or missing task is the tenant's default instruction, as in JoyNexus predict.
        task = batch.get("task", None)
        tasks = [task] * n if task is None or isinstance(task, str) else [str(t) for t in task]
        tasks = [t or cfg.default_task for t in tasks]
        adapters = None if self._adapter_key is None else [self._adapter_key] * n
        features = self._backbone.encode(images, tasks, adapters)
        return features.trimmed(), state

    @torch.no_grad()
    def predict_action_chunk(
        self, batch: dict[str, Any], noise: torch.Tensor | None = None, **kwargs: Any
    ) -> torch.Tensor:
        """(N, chunk_size, action_dim) actions for N observations."""
        features, state = self._features_and_state(batch)
        module = self.action_module
        if noise is not None:
            raise ValueError("noise: set JoyNexusConfig.noise_seed instead (the module draws its own x0)")
        if self.config.noise_seed is None:
            return module.predict(features, state)
        # One generator per observation, as the Inference Model Service does for seeded requests.
        rows = [
            module.predict(
                features.select([i]), state[i : i + 1], generator=torch.Generator().manual_seed(self.config.noise_seed)
            )
            for i in range(state.shape[0])
        ]
        return torch.cat(rows)

    @torch.no_grad()
    def select_action(self, batch: dict[str, Any], noise: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
        """The next action (N, action_dim): a new chunk every n_action_steps steps."""
        self.eval()
        if not self._queue:
            chunk = self.predict_action_chunk(batch, noise=noise)[:, : self.config.n_action_steps]
            self._queue.extend(chunk.transpose(0, 1))
        return self._queue.popleft()

    def forward(self, batch: dict[str, Any]) -> tuple[torch.Tensor, dict | None]:
        """The tenant module's own training loss on a LeRobot batch (the backbone stays frozen)."""
        features, state = self._features_and_state(batch)
        loss = self.action_module.loss(features, state, batch[ACTION], batch.get("action_is_pad"))
        return loss, {"loss": float(loss.detach())}
