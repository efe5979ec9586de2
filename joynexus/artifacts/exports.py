"""Exports that stock tools load: a tenant payload written out as plain directories.

``export_directory(payload, out_dir)`` writes one policy version (a ``TrainingModelService.
export_params`` payload, or ``checkpoint_payload`` of a checkpointed version) as::

    out_dir/
      joynexus_export.json          manifest, its digest, the payload's sha256, every file's sha256
      action_module/config.json     the action-module config (+ tenant, version, schema, base model)
      action_module/model.safetensors
      action_module/normalization.json  the version's normalizer (modes + statistics), when it has one
      adapter/adapter_config.json   LoRA tenants only: a PEFT adapter directory for the backbone's
      adapter/adapter_model.safetensors  text model

Every file is a function of the payload (and ``base_model_path``) alone, and exports of one version
are byte-identical, so the same version always exports to the same bytes and the same digests
(``joynexus_export.json``'s ``manifest_digest`` and ``payload_sha256`` equal the registry's tags).

Loading the action module needs only safetensors and the module classes (no JoyNexus service)::

    import json
    from safetensors.torch import load_file
    from joynexus.models.action_modules import build_action_module

    root = "out_dir/action_module"
    with open(f"{root}/config.json") as f:
        config = json.load(f)
    module = build_action_module(config["action_module"])  # the registry picks the class by "kind"
    module.load_state_dict(load_file(f"{root}/model.safetensors"))
    module.eval()
    # actions = module.predict(features, state)  with features from the same base model

Loading a LoRA tenant's adapter is stock peft on the base model's text model (the backbone directory
``ResidentBackbone.save_pretrained`` writes, or a SmolVLM / Idefics3 checkpoint it was built from)::

    from peft import PeftModel
    from transformers import AutoModel

    base = AutoModel.from_pretrained("path/to/backbone")  # Idefics3Model
    text_model = PeftModel.from_pretrained(base.text_model, "out_dir/adapter")
    # base.text_model now carries the adapter (peft injects it in place), so `base` runs with it too

``load_action_module(out_dir)`` does the first snippet.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from safetensors.torch import load_file

from joynexus.artifacts.codec import (
    NORMALIZATION_FILE,
    TenantManifest,
    _prepare_tensors,
    _save_tensors,
    _sha256,
    decode_tenant_payload,
    encode_tenant_payload,
    export_manifest,
    payload_digest,
)

if TYPE_CHECKING:  # torch models are imported only when a directory is written or loaded
    from joynexus.artifacts.checkpoints import CheckpointStore
    from joynexus.models.action_modules import ActionModule

__all__ = [
    "ACTION_MODULE_CONFIG_FILE",
    "ACTION_MODULE_DIR",
    "ACTION_MODULE_FORMAT",
    "ACTION_MODULE_WEIGHTS_FILE",
    "ADAPTER_DIR",
    "EXPORT_INFO_FILE",
    "PEFT_CONFIG_FILE",
    "PEFT_KEY_PREFIX",
    "PEFT_WEIGHTS_FILE",
    "ExportInfo",
    "checkpoint_payload",
    "export_directory",
    "export_files",
    "load_action_module",
]

EXPORT_INFO_FILE = "joynexus_export.json"
ACTION_MODULE_DIR = "action_module"
ACTION_MODULE_CONFIG_FILE = "config.json"
ACTION_MODULE_WEIGHTS_FILE = "model.safetensors"
ACTION_MODULE_FORMAT = "joynexus-action-module/1"
ADAPTER_DIR = "adapter"
PEFT_CONFIG_FILE = "adapter_config.json"  # peft.utils.CONFIG_NAME
PEFT_WEIGHTS_FILE = "adapter_model.safetensors"  # peft.utils.SAFETENSORS_WEIGHTS_NAME
# PeftModel.save_pretrained's key prefix: keys are relative to the PeftModel wrapping the base model.
PEFT_KEY_PREFIX = "base_model.model."
_ST_METADATA = {"format": "pt"}  # what transformers / peft write, so their loaders take the files as torch


@dataclass(frozen=True)
class ExportInfo:
    """What `export_directory` wrote."""

    root: Path
    manifest: TenantManifest
    manifest_digest: str  # = the registry's manifest_digest tag of this version
    payload_sha256: str  # = the registry's payload_sha256 tag of this version
    files: dict[str, str]  # path relative to root -> sha256 of its bytes (joynexus_export.json excluded)


def _json_bytes(value: Any) -> bytes:
    return (json.dumps(value, indent=2, sort_keys=True, allow_nan=False, default=_json_default) + "\n").encode("utf-8")


def _json_default(value: Any) -> Any:
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    if hasattr(value, "value"):  # enums (peft's PeftType / TaskType are str enums)
        return value.value
    raise TypeError(f"not JSON-serialisable: {type(value).__name__}")


def export_files(payload: bytes, *, base_model_path: str | None = None) -> tuple[TenantManifest, dict[str, bytes]]:
    """The export of ``payload`` as (its manifest, relative path -> file bytes); nothing is written.
    ``base_model_path`` goes into the adapter config's ``base_model_name_or_path`` (default: the
    manifest's base model id)."""
    from joynexus.models.adapters import LoraAdapterConfig, split_tenant_state

    tensors, manifest = decode_tenant_payload(payload)
    module_state, adapter_state = split_tenant_state(tensors)
    files: dict[str, bytes] = {}
    config = {
        "format": ACTION_MODULE_FORMAT,
        "action_module": manifest.module_config,
        "tenant_id": manifest.tenant_id,
        "policy_version": manifest.policy_version,
        "schema_signature": manifest.schema_signature,
        "base_model_id": manifest.base_model_id,
        "manifest_digest": manifest.digest,
    }
    files[f"{ACTION_MODULE_DIR}/{ACTION_MODULE_CONFIG_FILE}"] = _json_bytes(config)
    files[f"{ACTION_MODULE_DIR}/{ACTION_MODULE_WEIGHTS_FILE}"] = _save_tensors(
        _prepare_tensors(module_state, "module_state"), dict(_ST_METADATA)
    )
    normalization = manifest.extra.get("normalization")
    if normalization:  # the version's normalizer: whoever runs the module un-normalizes its actions with it
        files[f"{ACTION_MODULE_DIR}/{NORMALIZATION_FILE}"] = _json_bytes(normalization)
    adapter = manifest.extra.get("adapter")
    if adapter is not None or adapter_state:
        if adapter is None or not adapter_state:
            raise ValueError(
                f"payload of tenant {manifest.tenant_id!r} v{manifest.policy_version}: adapter tensors and "
                "the manifest's extra.adapter must come together"
            )
        peft_config = LoraAdapterConfig.model_validate(adapter).peft_config(
            base_model_path if base_model_path is not None else manifest.base_model_id, inference_mode=True
        )
        files[f"{ADAPTER_DIR}/{PEFT_CONFIG_FILE}"] = _json_bytes(peft_config.to_dict())
        peft_tensors = {PEFT_KEY_PREFIX + key: value for key, value in adapter_state.items()}
        files[f"{ADAPTER_DIR}/{PEFT_WEIGHTS_FILE}"] = _save_tensors(
            _prepare_tensors(peft_tensors, "adapter_state"), dict(_ST_METADATA)
        )
    return manifest, files


def export_directory(payload: bytes, out_dir: str | Path, *, base_model_path: str | None = None) -> ExportInfo:
    """Write ``payload`` as the directories described in this module's docstring. ``out_dir`` must
    not exist or be empty. The same payload always gives byte-identical files."""
    root = Path(out_dir).expanduser()
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise FileExistsError(f"export directory {str(root)!r} exists and is not an empty directory")
    manifest, files = export_files(payload, base_model_path=base_model_path)
    hashes = {name: _sha256(data) for name, data in sorted(files.items())}
    info = {
        "manifest": json.loads(manifest.to_json()),
        "manifest_digest": manifest.digest,
        "payload_sha256": payload_digest(payload),
        "files": hashes,
    }
    for name, data in [*files.items(), (EXPORT_INFO_FILE, _json_bytes(info))]:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return ExportInfo(
        root=root,
        manifest=manifest,
        manifest_digest=manifest.digest,
        payload_sha256=info["payload_sha256"],
        files=hashes,
    )


def checkpoint_payload(store: CheckpointStore, tenant_id: str, version: int | None = None) -> bytes:
    """The export payload of a checkpointed version (None: LATEST): its tensors with
    `export_manifest` of its checkpoint manifest, i.e. the same bytes `export_params` gave for that
    version while the Training Model Service held it."""
    manifest, state, _ = store.load_tenant(tenant_id, version)
    return encode_tenant_payload(state, export_manifest(manifest))


def load_action_module(out_dir: str | Path) -> ActionModule:
    """The action module of an export directory, by the documented recipe (stock safetensors)."""
    from joynexus.models.action_modules import build_action_module

    root = Path(out_dir) / ACTION_MODULE_DIR
    config = json.loads((root / ACTION_MODULE_CONFIG_FILE).read_text())
    if config.get("format") != ACTION_MODULE_FORMAT:
        raise ValueError(
            f"{root / ACTION_MODULE_CONFIG_FILE}: format {config.get('format')!r} is not {ACTION_MODULE_FORMAT!r}"
        )
    module = build_action_module(config["action_module"])
    module.load_state_dict(load_file(str(root / ACTION_MODULE_WEIGHTS_FILE)))
    return module.eval()
