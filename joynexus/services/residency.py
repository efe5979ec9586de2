"""Bounded tenant residency: which tenants' tensors are in memory, with the rest paged out to disk.

The Training and Inference Model Services hold something per tenant (a training slot: module, AdamW
state, counters; a serving state: one version's module and adapter). Thousands of registered tenants
do not fit in memory at once, and most are idle at any moment. `TenantResidency` keeps them in two
tiers, the shape of vLLM's LoRA managers (`max_loras` resident on the device, `max_cpu_loras` behind
them), with a local disk folder as the second tier:

- resident: in memory, bounded by a count (`max_resident`) and optionally by bytes
  (`max_resident_bytes`), in least-recently-used order;
- paged out: one safetensors file per entry in a spill folder (tensors written as CPU tensors,
  everything else as JSON in the file's metadata), written atomically (a temporary file, then
  `os.replace`), so a page-in never reads a torn file.

The Training Model Service splits its resident tier in two (`services.training.packing`): at most
`max_active_tenants` slots are active (module and AdamW as live objects), the other resident ones
are packed into a few flat tensors and materialized, without a copy, on use. So a training slot is
active, packed resident, or paged out; that split is the service's business, not this module's.

Using an entry (`use`) pages it in if needed and makes it the most recently used; when a bound is
exceeded the least recently used entry that is neither pinned nor refused by its pager is paged out.
A pinned entry (a tenant in the middle of a training step, a serving state with a request queued or
in a physical batch) is never paged out; while pins keep more entries resident than the bound
allows, the bound is exceeded (counted in `over_bound`) and restored when the pins go.

Pins come from scopes: inside `with residency.scope():` every entry `use` returns stays pinned until
the outermost scope of the calling thread exits, or, with `scope.hold_until(future)`, until that
future settles (a queued request). The method decorators `pins_during_call` and `pins_until_settled`
open such a scope around one service method, so an entry used anywhere inside one call stays
resident for the whole call (or until the future the call returns settles).

`LruCache` is the one least-recently-used bookkeeping of the services (this residency's resident
order, the training service's active tier, the inference service's versions per tenant): an
ordered map with an eviction hook, the shape of vLLM's `LRUCache` with its `_on_remove`.

What an entry is, is the pager's business (`Pager`): what to write (`spill`), how to rebuild it
(`restore`), what to release once it is out of memory (`evicted`: e.g. its adapter on the shared
backbone), how many bytes it holds, whether it may leave now (`can_page_out`), and whether it ever
changes (`immutable`: written once, when added, so a page-out only drops it and never puts a write
on a request's path). Every pager call runs under the residency's lock: a pager may take its
service's locks, and its service must never call the residency while holding one of them.

The spill folder is a cache of this process, not a checkpoint: files are not fsynced, and the folder
is deleted when the residency is closed or garbage-collected (or the interpreter exits). Durable
state is the Training Model Service's checkpoints.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import re
import shutil
import socket
import struct
import tempfile
import threading
import uuid
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors
from safetensors.torch import save_file

__all__ = [
    "DEFAULT_MAX_RESIDENT_SERVING",
    "DEFAULT_MAX_RESIDENT_TENANTS",
    "LruCache",
    "Pager",
    "PinScope",
    "ResidencyLimits",
    "TenantResidency",
    "UnknownEntry",
    "decode_paged",
    "encode_paged",
    "pins_during_call",
    "pins_until_settled",
    "rebuild_module",
    "tensor_bytes",
]

# Defaults of the services' resident bounds (Settings: JOYNEXUS_MAX_RESIDENT_TENANTS / _SERVING): high
# enough that a small deployment never pages; a serving state is one (tenant, version), and the
# Inference Model Service keeps up to 3 versions per tenant.
DEFAULT_MAX_RESIDENT_TENANTS = 256
DEFAULT_MAX_RESIDENT_SERVING = 1024

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")
R = TypeVar("R")

_META_KEY = "joynexus.residency"  # the safetensors metadata entry holding the pager's JSON
_FILE_SUFFIX = ".safetensors"
_UNSAFE_CHARS = re.compile(r"[^A-Za-z0-9._-]+")


class UnknownEntry(KeyError):
    """The key was never added (or was removed)."""


@dataclass(frozen=True)
class ResidencyLimits:
    """The resident tier's bounds: at most `max_resident` entries and, if set, `max_resident_bytes`
    bytes of tensors (as the pager counts them). Validated here, errors name the field and value."""

    max_resident: int
    max_resident_bytes: int | None = None
    # How the caller names the two fields (a service's own argument or setting), for error messages.
    names: tuple[str, str] = field(default=("max_resident", "max_resident_bytes"), compare=False)

    def __post_init__(self) -> None:
        count, size = self.names
        if isinstance(self.max_resident, bool) or not isinstance(self.max_resident, int) or self.max_resident < 1:
            raise ValueError(f"{count}: must be an integer >= 1, got {self.max_resident!r}")
        if self.max_resident_bytes is not None and (
            isinstance(self.max_resident_bytes, bool)
            or not isinstance(self.max_resident_bytes, int)
            or self.max_resident_bytes < 1
        ):
            raise ValueError(
                f"{size}: must be an integer >= 1 or None (no byte bound), got {self.max_resident_bytes!r}"
            )


class Pager(Protocol[K, V]):
    """How one kind of entry goes to disk and comes back (see the module docstring)."""

    immutable: bool  # True: an entry never changes once added, so its file is written once, at `add`

    def nbytes(self, value: V) -> int:
        """Bytes of tensors the entry holds in memory (what `max_resident_bytes` bounds)."""
        ...

    def can_page_out(self, key: K, value: V) -> bool:
        """False while the entry must stay in memory for a reason of its own (pending gradients)."""
        ...

    def spill(self, key: K, value: V) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Everything needed to rebuild the entry exactly: tensors (any device) and JSON-able metadata."""
        ...

    def evicted(self, key: K, value: V) -> None:
        """The entry was paged out (its file is written): release what it holds outside itself."""
        ...

    def restore(self, key: K, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> V:
        """Rebuild the entry from what `spill` returned (tensors come back as CPU tensors)."""
        ...

    def at_rest(self, key: K, value: V) -> None:
        """The entry's last pin was released (e.g. free gradients no step needs any more)."""
        ...


def rebuild_module(
    factory: Callable[[], torch.nn.Module], state: Mapping[str, torch.Tensor], device: torch.device | str
) -> torch.nn.Module:
    """A module from its paged-out state dict, on `device`, strictly loaded. `factory()`'s initial
    draw is overwritten, so it runs under a forked RNG: a page-in never moves the global random
    stream. (Building on the meta device and assigning the tensors skips that draw, but its
    dispatch made a tiny module's page-in 3x slower here: 3.6 ms vs 1.2 ms.)"""
    with torch.random.fork_rng(devices=[]):
        module = factory()
    module.to(device).load_state_dict(state, strict=True)
    return module


def tensor_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the given tensors' elements (None entries, e.g. absent gradients, count 0)."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class LruCache(Generic[K, V]):
    """An ordered map, least recently used first, with an eviction hook (vLLM's `LRUCache` with its
    `_on_remove`). `get` and `put` make a key the most recently used; `in`, `peek`, `len` and
    iteration (least recently used first) do not. `evict_least_recent` removes the least recently
    used entry and passes it to `on_evict`; so does `put` beyond `capacity` (None: unbounded, the
    owner evicts). `pop` removes without the hook (the owner drops the entry itself).
    Not thread-safe: its owner's lock guards it."""

    def __init__(self, capacity: int | None = None, on_evict: Callable[[K, V], None] | None = None) -> None:
        if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1):
            raise ValueError(f"capacity: must be an integer >= 1 or None, got {capacity!r}")
        self.capacity = capacity
        self.on_evict = on_evict
        self._entries: OrderedDict[K, V] = OrderedDict()

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[K]:
        return iter(self._entries)

    def keys(self) -> list[K]:
        """A snapshot of the keys, least recently used first."""
        return list(self._entries)

    def get(self, key: K, default: V | None = None) -> V | None:
        """The value (now the most recently used), or `default` when absent."""
        if key not in self._entries:
            return default
        self._entries.move_to_end(key)
        return self._entries[key]

    def peek(self, key: K, default: V | None = None) -> V | None:
        """The value, or `default`; the order is left as it is."""
        return self._entries.get(key, default)

    def touch(self, key: K) -> bool:
        """Make `key` the most recently used if present; whether it was."""
        if key not in self._entries:
            return False
        self._entries.move_to_end(key)
        return True

    def put(self, key: K, value: V) -> None:
        """Insert or replace `key`, now the most recently used; beyond `capacity`, evict the least
        recently used others."""
        self._entries[key] = value
        self._entries.move_to_end(key)
        while self.capacity is not None and len(self._entries) > self.capacity:
            self.evict_least_recent()

    def pop(self, key: K, default: V | None = None) -> V | None:
        """Remove `key` without the eviction hook; its value, or `default` when absent."""
        return self._entries.pop(key, default)

    def evict_least_recent(self, unless: Callable[[K, V], bool] | None = None) -> tuple[K, V] | None:
        """Remove the least recently used entry (skipping those `unless` keeps) and pass it to
        `on_evict`; the entry, or None when none could go."""
        for key, value in self._entries.items():
            if unless is not None and unless(key, value):
                continue
            del self._entries[key]
            if self.on_evict is not None:
                self.on_evict(key, value)
            return key, value
        return None

    def clear(self) -> None:
        """Forget every entry (no eviction hook)."""
        self._entries.clear()


@dataclass
class _Entry(Generic[V]):
    value: V | None  # None: paged out (then `path` holds it)
    nbytes: int = 0
    pins: int = 0
    path: Path | None = None  # the spill file; for an immutable entry it stays valid while resident
    file_bytes: int = 0


@dataclass
class _Stats:
    hits: int = 0  # `use` of a resident entry
    page_ins: int = 0
    page_outs: int = 0
    files_written: int = 0  # spill files written (an immutable entry's once, when added)
    over_bound: int = 0  # times the bound could not be restored (everything left was pinned)


@dataclass
class PinScope:
    """The pins one outermost scope holds (see `TenantResidency.scope`)."""

    residency: TenantResidency[Any, Any]
    pins: list[tuple[Any, _Entry[Any]]] = field(default_factory=list)  # (key, the entry pinned)

    def hold_until(self, future: Future) -> None:
        """Keep the pins taken so far until `future` settles instead of until the scope exits."""
        pins, self.pins = self.pins, []
        future.add_done_callback(lambda _: self.residency._unpin_all(pins))


class TenantResidency(Generic[K, V]):
    """An LRU of entries in two tiers, resident and paged out to a spill folder (module docstring).

    It reads as a mapping of every registered key (`in`, `len`, iteration over all keys, resident
    or not; `residency[key]` is `use(key)`)."""

    def __init__(
        self,
        pager: Pager[K, V],
        limits: ResidencyLimits,
        spill_dir: str | Path | None = None,
        *,
        name: str = "residency",
    ) -> None:
        """`spill_dir`: the folder under which this residency makes its own subfolder (removed on
        `close`); None: a fresh temporary folder."""
        self.pager = pager
        self.limits = limits
        self.name = name
        base = Path(spill_dir) if spill_dir is not None else Path(tempfile.gettempdir())
        base.mkdir(parents=True, exist_ok=True)
        # One folder per residency (per service incarnation): two processes never share files. Named
        # by host and pid, so folders a killed process left (a Ray actor restarted in place) go now.
        prefix = f"{_safe(name)}-{_safe(socket.gethostname())}"
        _sweep_dead_folders(base, prefix)
        self.spill_dir = Path(tempfile.mkdtemp(prefix=f"{prefix}-{os.getpid()}-", dir=base))
        self._finalizer = weakref.finalize(self, shutil.rmtree, str(self.spill_dir), ignore_errors=True)
        self._entries: dict[K, _Entry[V]] = {}
        self._lru: LruCache[K, None] = LruCache()  # resident keys, least recently used first
        self._resident_bytes = 0
        self._lock = threading.RLock()
        self._local = threading.local()  # the calling thread's open scope
        self._stats = _Stats()

    # -- mapping view ---------------------------------------------------------------------
    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._entries

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def __iter__(self) -> Iterator[K]:
        with self._lock:
            return iter(list(self._entries))  # a snapshot: others may add or remove meanwhile

    def __getitem__(self, key: K) -> V:
        return self.use(key)

    def keys(self) -> list[K]:
        with self._lock:
            return list(self._entries)

    def is_resident(self, key: K) -> bool:
        with self._lock:
            entry = self._entries.get(key)
            return entry is not None and entry.value is not None

    def resident_keys(self) -> list[K]:
        """Resident keys, least recently used first."""
        with self._lock:
            return self._lru.keys()

    def pins(self, key: K) -> int:
        with self._lock:
            return self._entry(key).pins

    # -- entries --------------------------------------------------------------------------
    def add(self, key: K, value: V) -> V | None:
        """Register `key` as resident and most recently used (paging others out past the bound).
        Replaces an existing entry; returns the replaced value if it was resident (the caller
        releases what it holds), else None."""
        with self._lock:
            replaced = self._drop(key)
            entry: _Entry[V] = _Entry(value=value, nbytes=self.pager.nbytes(value))
            if self.pager.immutable:  # written now, so paging it out later is only dropping it
                entry.path, entry.file_bytes = self._write(key, *self.pager.spill(key, value))
                self._stats.files_written += 1
            self._entries[key] = entry
            self._lru.put(key, None)
            self._resident_bytes += entry.nbytes
            self._pin_in_scope(key, entry)
            self._enforce(keep=key)
            return replaced

    def use(self, key: K) -> V:
        """The entry, paged in if it was out, now the most recently used; pinned until the calling
        thread's scope ends if one is open. Raises `UnknownEntry` for a key never added."""
        with self._lock:
            entry = self._entry(key)
            if entry.value is None:
                self._page_in(key, entry)
            else:
                self._stats.hits += 1
                self._lru.touch(key)
            self._pin_in_scope(key, entry)
            self._enforce(keep=key)
            assert entry.value is not None
            return entry.value

    def peek(self, key: K) -> V | None:
        """The resident value, or None if paged out or unknown; no page-in, no LRU change."""
        with self._lock:
            entry = self._entries.get(key)
            return None if entry is None else entry.value

    def remove(self, key: K) -> V | None:
        """Forget `key` and delete its spill file; returns its value if it was resident (the caller
        releases what it holds), else None. Pins on it lapse (their release is a no-op)."""
        with self._lock:
            return self._drop(key)

    def detach(self, key: K) -> bytes:
        """Take `key` out in the paging format (what a page-out writes: its spill file's bytes if it
        is paged out, else the pager's spill of its value) and forget it, as `remove` does; the bytes
        restore elsewhere with the same kind of pager (`decode_paged`, `Pager.restore`): a tenant
        moving between shards. Refused while the value is pinned or its pager will not let it go."""
        with self._lock:
            entry = self._entry(key)
            if entry.pins:
                raise RuntimeError(f"{self.name}: {key!r} is in use ({entry.pins} pins) and cannot be detached")
            if entry.value is None:
                assert entry.path is not None
                data = entry.path.read_bytes()
            else:
                if not self.pager.can_page_out(key, entry.value):
                    raise RuntimeError(f"{self.name}: {key!r} cannot leave now (its pager refuses a page-out)")
                data = encode_paged(*self.pager.spill(key, entry.value))
                self.pager.evicted(key, entry.value)
            self._drop(key)
            return data

    def page_out(self, key: K) -> bool:
        """Page `key` out now; False if it is not resident, pinned, or refused by its pager."""
        with self._lock:
            entry = self._entry(key)
            if entry.value is None or entry.pins or not self.pager.can_page_out(key, entry.value):
                return False
            self._page_out(key, entry)
            return True

    def pin(self, key: K) -> V:
        """Page in and pin `key` until `unpin` (for pins outside a scope)."""
        with self._lock:
            value = self.use(key)
            self._entries[key].pins += 1
            return value

    def unpin(self, key: K) -> None:
        with self._lock:
            self._unpin_all([(key, self._entry(key))])

    # -- scopes ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def scope(self) -> Iterator[PinScope]:
        """Pin every entry `use`d by this thread until the outermost scope exits (nested scopes join
        the outer one), or until a future given to `PinScope.hold_until` settles."""
        outer: PinScope | None = getattr(self._local, "scope", None)
        if outer is not None:
            yield outer
            return
        scope = PinScope(self)
        self._local.scope = scope
        try:
            yield scope
        finally:
            self._local.scope = None
            self._unpin_all(scope.pins)

    def _pin_in_scope(self, key: K, entry: _Entry[V]) -> None:
        scope: PinScope | None = getattr(self._local, "scope", None)
        if scope is not None:
            entry.pins += 1
            scope.pins.append((key, entry))

    def _unpin_all(self, pins: list[tuple[K, _Entry[V]]]) -> None:
        if not pins:
            return
        with self._lock:
            for key, entry in pins:
                if self._entries.get(key) is not entry or entry.pins == 0:  # removed or replaced meanwhile
                    continue
                entry.pins -= 1
                if entry.pins == 0 and entry.value is not None:
                    self.pager.at_rest(key, entry.value)
                    if not self.pager.immutable:  # an immutable entry keeps its size: no walk per request
                        self._recount(entry)  # a step may have grown it (AdamW state appears on the first)
            self._enforce(keep=None)

    # -- paging ---------------------------------------------------------------------------
    def _entry(self, key: K) -> _Entry[V]:
        entry = self._entries.get(key)
        if entry is None:
            raise UnknownEntry(f"{key!r} is not registered in this residency")
        return entry

    def _recount(self, entry: _Entry[V]) -> None:
        assert entry.value is not None
        nbytes = self.pager.nbytes(entry.value)
        self._resident_bytes += nbytes - entry.nbytes
        entry.nbytes = nbytes

    def _over(self) -> bool:
        limit = self.limits.max_resident_bytes
        return len(self._lru) > self.limits.max_resident or (limit is not None and self._resident_bytes > limit)

    def _enforce(self, keep: K | None) -> None:
        """Page out least recently used entries until within the bounds; `keep` (the entry being
        returned) and pinned or refused entries stay. Caller holds the lock."""
        if not self._over():
            return
        for key in self._lru.keys():
            if not self._over():
                return
            entry = self._entries[key]
            if key == keep or entry.pins or not self.pager.can_page_out(key, entry.value):
                continue
            self._page_out(key, entry)
        if self._over():
            self._stats.over_bound += 1

    def _page_out(self, key: K, entry: _Entry[V]) -> None:
        value = entry.value
        assert value is not None
        if not (self.pager.immutable and entry.path is not None):
            tensors, meta = self.pager.spill(key, value)
            entry.path, entry.file_bytes = self._write(key, tensors, meta)
            self._stats.files_written += 1
        entry.value = None
        self._lru.pop(key)
        self._resident_bytes -= entry.nbytes
        entry.nbytes = 0
        self._stats.page_outs += 1
        self.pager.evicted(key, value)

    def _page_in(self, key: K, entry: _Entry[V]) -> None:
        assert entry.path is not None
        # One read, then tensors built from the bytes (copies: the file may go right after).
        tensors, meta = decode_paged(entry.path.read_bytes())
        entry.value = self.pager.restore(key, tensors, meta)
        if not self.pager.immutable:  # it will change: the file is stale from its first step on
            self._delete_file(entry)
        entry.nbytes = self.pager.nbytes(entry.value)
        self._resident_bytes += entry.nbytes
        self._lru.put(key, None)
        self._stats.page_ins += 1

    def _write(self, key: K, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> tuple[Path, int]:
        path = self.spill_dir / _file_name(key)
        tmp = self.spill_dir / f".tmp-{uuid.uuid4().hex}{_FILE_SUFFIX}"
        # CPU, contiguous, and unshared storage: what safetensors writes (views and tied tensors it refuses).
        cpu = {name: t.detach().to("cpu", copy=t.device.type == "cpu").contiguous() for name, t in tensors.items()}
        try:
            save_file(cpu, str(tmp), metadata={_META_KEY: json.dumps(meta, separators=(",", ":"))})
            os.replace(tmp, path)  # atomic: a reader sees the old file or the whole new one
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return path, path.stat().st_size

    def _delete_file(self, entry: _Entry[V]) -> None:
        if entry.path is not None:
            entry.path.unlink(missing_ok=True)
        entry.path, entry.file_bytes = None, 0

    def _drop(self, key: K) -> V | None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return None
        self._lru.pop(key)
        self._resident_bytes -= entry.nbytes
        self._delete_file(entry)
        entry.pins = 0
        return entry.value

    # -- status ---------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        with self._lock:
            entries = self._entries.values()
            return {
                "registered": len(self._entries),
                "resident": len(self._lru),
                "paged_out": len(self._entries) - len(self._lru),
                "pinned": sum(1 for e in entries if e.pins),
                "resident_bytes": self._resident_bytes,
                "spill_bytes": sum(e.file_bytes for e in entries),
                "max_resident": self.limits.max_resident,
                "max_resident_bytes": self.limits.max_resident_bytes,
                "spill_dir": str(self.spill_dir),
                **vars(self._stats),
            }

    def close(self) -> None:
        """Forget every entry and delete the spill folder."""
        with self._lock:
            self._entries.clear()
            self._lru.clear()
            self._resident_bytes = 0
            self._finalizer()


def encode_paged(tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> bytes:
    """A pager's (tensors, meta) as the bytes of a spill file (safetensors, the JSON in its metadata)."""
    cpu = {name: t.detach().to("cpu", copy=t.device.type == "cpu").contiguous() for name, t in tensors.items()}
    return save_tensors(cpu, metadata={_META_KEY: json.dumps(dict(meta), separators=(",", ":"))})


def decode_paged(data: bytes) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The (tensors, meta) of a spill file's bytes (`encode_paged`, a page-out's file)."""
    (header_length,) = struct.unpack("<Q", data[:8])
    meta = json.loads(json.loads(data[8 : 8 + header_length])["__metadata__"][_META_KEY])
    return load_tensors(data), meta


def pins_during_call(residency_attribute: str) -> Callable[[Callable[..., R]], Callable[..., R]]:
    """Decorator of a service method: the entries it uses (in the residency held at
    `self.<residency_attribute>`) stay pinned, so resident, until it returns."""

    def decorate(method: Callable[..., R]) -> Callable[..., R]:
        @functools.wraps(method)
        def call(self: Any, *args: Any, **kwargs: Any) -> R:
            with getattr(self, residency_attribute).scope():
                return method(self, *args, **kwargs)

        return call

    return decorate


def pins_until_settled(residency_attribute: str) -> Callable[[Callable[..., Future]], Callable[..., Future]]:
    """Decorator of a method that returns a future (a queued request): the entries it uses stay
    pinned until that future settles (served, failed or cancelled), or until it raises."""

    def decorate(method: Callable[..., Future]) -> Callable[..., Future]:
        @functools.wraps(method)
        def call(self: Any, *args: Any, **kwargs: Any) -> Future:
            with getattr(self, residency_attribute).scope() as scope:
                future = method(self, *args, **kwargs)
                scope.hold_until(future)
                return future

        return call

    return decorate


def _sweep_dead_folders(base: Path, prefix: str) -> None:
    """Delete spill folders `prefix-<pid>-*` of this host whose process is gone (killed before it
    could clean up). A pid that is alive, or not ours to signal, keeps its folder."""
    for folder in base.glob(f"{prefix}-*"):
        pid = folder.name[len(prefix) + 1 :].split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(folder, ignore_errors=True)
        except OSError:  # alive under another user: not ours to judge
            pass


def _safe(text: str) -> str:
    return _UNSAFE_CHARS.sub("_", text)[:80] or "entry"


def _file_name(key: Hashable) -> str:
    """A readable, collision-free file name for a key (tenant ids, (tenant, version) pairs)."""
    parts = key if isinstance(key, tuple) else (key,)
    digest = hashlib.sha256(repr(key).encode()).hexdigest()[:16]
    return f"{_safe('-'.join(str(p) for p in parts))}-{digest}{_FILE_SUFFIX}"
