"""A checkpoint directory's backbone family, checked before anything starts (issue 41.10): a
`JOYNEXUS_BACKBONE_PATH` whose config.json names a model_type no family serves (Qwen2-VL,
Qwen2.5-VL, ...) used to fail deep inside the Training Model Service's construction, and
`joynexus serve` / `up` ended in a 93-line traceback. `joynexus serve` and `joynexus up` print
this one line and exit 2 instead."""

from __future__ import annotations

import json
from pathlib import Path

from joynexus.settings import Settings

__all__ = ["backbone_directory_problem"]


def backbone_directory_problem(settings: Settings) -> str | None:
    """One line naming the directory, its model_type and the families that exist (with the
    model_types each serves), when `settings.backbone_path` names a model_type no registered
    family serves; None otherwise (a directory without a readable config.json is the loader's
    to describe, with what is missing)."""
    if not settings.backbone_path:
        return None
    root = Path(settings.backbone_path).expanduser()
    try:
        model_type = json.loads((root / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(model_type, str):
        return None
    from joynexus.models.backbone import BACKBONE_FAMILIES  # registers every family

    families = {name: tuple(family.model_types) for name, family in BACKBONE_FAMILIES.items()}
    if any(model_type in served for served in families.values()):
        return None
    listed = "; ".join(f"{name} (model_type {', '.join(served)})" for name, served in sorted(families.items()))
    return (
        f"JOYNEXUS_BACKBONE_PATH {str(root)!r}: its config.json has model_type {model_type!r}, which no backbone "
        f"family serves; the families are: {listed}"
    )
