"""Crash leftovers of the checkpoint store, and their removal.

A process that dies mid-write leaves what its atomic write had not finished: a temp entry
(``.tmp-*``: a folder `publish_dir` was filling, a file `put_atomic` was writing, a folder
`delete_prefix` had moved aside) or, on an object store, a version folder whose manifest (the
commit marker, written last) never arrived. No reader ever sees them as versions, so they are
never billed (`CheckpointStore.tenant_bytes` counts committed versions and pointers only), and
`sweep_leftovers` deletes the ones older than a grace period (a younger one may be a write in
progress). The Master Service sweeps when it starts and then periodically.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

from joynexus.artifacts.codec import _TMP_PREFIX, _VERSION_DIR_RE, MANIFEST_FILE

if TYPE_CHECKING:
    from joynexus.artifacts.checkpoints import CheckpointStore

log = logging.getLogger(__name__)

# A leftover younger than this may be a write in progress (a large checkpoint uploading).
DEFAULT_GRACE_S = 3600.0


def leftover_entries(listing: Mapping[str, object]) -> set[str]:
    """The top-level entries of one tenant's listing (keys relative to ``tenants/<id>``) that are
    crash leftovers: temp entries and version folders without a manifest."""
    committed = {key.partition("/")[0] for key in listing if key.partition("/")[2] == MANIFEST_FILE}
    out: set[str] = set()
    for key in listing:
        entry, sep, _ = key.partition("/")
        if entry.startswith(_TMP_PREFIX) or (sep and _VERSION_DIR_RE.fullmatch(entry) and entry not in committed):
            out.add(entry)
    return out


def billable_bytes(sizes: Mapping[str, int]) -> int:
    """Bytes of one tenant's listing (key -> size) without its crash leftovers."""
    leftovers = leftover_entries(sizes)
    return sum(size for key, size in sizes.items() if key.partition("/")[0] not in leftovers)


def sweep_leftovers(store: CheckpointStore, *, grace_s: float = DEFAULT_GRACE_S, now: float | None = None) -> list[str]:
    """Delete every crash leftover under ``tenants/`` last modified more than `grace_s` ago, from
    one listing of the store; returns the removed keys (``tenants/...``). A store that cannot tell
    an object's age (no `list_modified`) or cannot delete is left alone."""
    blobs = store.blobs
    list_modified = getattr(blobs, "list_modified", None)
    delete = getattr(blobs, "delete_prefix", None)
    if list_modified is None or delete is None:
        return []
    now = time.time() if now is None else now
    modified = list_modified("tenants")
    candidates: dict[str, float] = {}  # entry key under tenants/ -> newest modification inside it
    per_tenant: dict[str, dict[str, float]] = {}
    for key, when in modified.items():
        head, sep, rest = key.partition("/")
        if head.startswith(_TMP_PREFIX):  # a tenant folder delete_prefix moved aside
            candidates[head] = max(candidates.get(head, 0.0), when)
        elif sep:
            per_tenant.setdefault(head, {})[rest] = when
    for tenant, listing in per_tenant.items():
        for entry in leftover_entries(listing):
            newest = max(when for key, when in listing.items() if key.partition("/")[0] == entry)
            candidates[f"{tenant}/{entry}"] = newest
    removed = []
    for entry, newest in sorted(candidates.items()):
        if now - newest < grace_s:
            continue
        try:
            delete(f"tenants/{entry}")
            removed.append(f"tenants/{entry}")
        except (OSError, ValueError) as error:  # gone already, or not ours to delete: the next sweep
            log.warning("removing checkpoint leftover tenants/%s failed: %s", entry, error)
    if removed:
        log.info("removed %d checkpoint leftovers: %s", len(removed), removed[:10])
    return removed
