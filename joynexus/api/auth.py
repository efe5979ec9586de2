"""API keys: issued at random, stored hashed, compared in constant time.

A key reads ``jnx_<key_id>_<secret>``: `key_id` (16 hex) is a public lookup handle, `secret` 32
random bytes. The store keeps only sha256 of the whole key — a key has 256 bits of entropy, so a
fast hash is enough (a slow KDF only matters for guessable passwords) — and `verify` compares
digests with `hmac.compare_digest`, hashing a dummy when the key id is unknown so that the work
done does not say whether an id exists.

Every tenant key is bound to one tenant; the admin key (env `JOYNEXUS_ADMIN_KEY`, or one generated
at the first start and printed once) creates tenants and issues keys.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import re
import secrets
import threading
import time
from dataclasses import dataclass

import anyio.to_thread
from sqlalchemy import select

from joynexus.core.store import ApiKeyRecord, ControlPlaneStore, utcnow
from joynexus.protocol.schemas import IssuedKey, KeyInfo

ADMIN_KEY_ENV = "JOYNEXUS_ADMIN_KEY"
KEY_PREFIX = "jnx"
_KEY_RE = re.compile(r"^jnx_([0-9a-f]{16})_([A-Za-z0-9_-]{43})$")
ADMIN, TENANT = "admin", "tenant"
_DUMMY_DIGEST = hashlib.sha256(b"joynexus: no such key").hexdigest()


@dataclass(frozen=True)
class Principal:
    """Who is calling: a tenant (every call scoped to `tenant_id`) or the admin."""

    role: str
    tenant_id: str | None
    key_id: str

    @property
    def is_admin(self) -> bool:
        return self.role == ADMIN


def key_digest(api_key: str) -> str:
    return hashlib.sha256(api_key.encode("utf-8")).hexdigest()


def new_api_key() -> tuple[str, str]:
    """(key_id, api_key) with a fresh random secret."""
    key_id = secrets.token_hex(8)
    return key_id, f"{KEY_PREFIX}_{key_id}_{secrets.token_urlsafe(32)}"


def _iso(value: object) -> str | None:
    return value.isoformat() if value is not None else None  # type: ignore[attr-defined]


def _info(record: ApiKeyRecord) -> KeyInfo:
    return KeyInfo(
        key_id=record.key_id,
        tenant_id=record.tenant_id,
        role=record.role,
        label=record.label,
        created_at=_iso(record.created_at) or "",
        revoked_at=_iso(record.revoked_at),
    )


VERIFIED_CACHE_S = 2.0  # how long a verified key is trusted without reading the store again
_VERIFIED_CACHE_MAX = 4096


class ApiKeyStore:
    """API keys in the control-plane store (table `api_keys`).

    Keys that verified are remembered for VERIFIED_CACHE_S (`cached`), so a tenant's every call does
    not take a worker thread for a store read: a burst of one tenant's calls would otherwise fill
    the shared thread pool with its own authentications. Only valid keys are kept (made-up keys
    cannot churn it); `revoke` and `forget_tenant` drop entries at once in this process, another
    API replica trusts a revoked key for at most VERIFIED_CACHE_S."""

    def __init__(self, store: ControlPlaneStore, admin_key: str | None = None):
        self.store = store
        self._admin_digest = key_digest(admin_key) if admin_key else None
        self._verified: dict[str, tuple[float, Principal]] = {}  # digest -> (verified at, principal)
        self._verified_lock = threading.Lock()
        self._pending: dict[str, asyncio.Future[Principal | None]] = {}  # digest -> its store read under way

    def cached(self, api_key: str) -> Principal | None:
        """The principal of a key verified less than VERIFIED_CACHE_S ago; None: ask `verify`."""
        digest = key_digest(api_key)
        with self._verified_lock:
            entry = self._verified.get(digest)
        if entry is None or time.monotonic() - entry[0] >= VERIFIED_CACHE_S:
            return None
        return entry[1]

    async def authenticate(self, api_key: str) -> Principal | None:
        """`verify` without blocking the event loop: a recently verified key from memory, else one
        store read in a worker thread, shared by every call that presents the same key meanwhile
        (a burst of one tenant's calls is one read, not a thread each)."""
        found = self.cached(api_key)
        if found is not None:
            return found
        digest = key_digest(api_key)
        pending = self._pending.get(digest)
        if pending is None:
            pending = self._pending[digest] = asyncio.ensure_future(anyio.to_thread.run_sync(self.verify, api_key))
            pending.add_done_callback(lambda _: self._pending.pop(digest, None))
        return await asyncio.shield(pending)

    def forget_tenant(self, tenant_id: str) -> None:
        """Forget the verified keys of a tenant (deleted: its key rows are gone)."""
        with self._verified_lock:
            for digest in [d for d, (_, p) in self._verified.items() if p.tenant_id == tenant_id]:
                del self._verified[digest]

    def _remember(self, digest: str, principal: Principal) -> None:
        with self._verified_lock:
            if len(self._verified) >= _VERIFIED_CACHE_MAX:
                self._verified.clear()  # rare (thousands of live keys within 2 s): start over
            self._verified[digest] = (time.monotonic(), principal)

    def issue(self, tenant_id: str | None, *, role: str = TENANT, label: str = "") -> IssuedKey:
        if role not in (ADMIN, TENANT):
            raise ValueError(f"role: {role!r} is not one of {[ADMIN, TENANT]}")
        if (role == TENANT) != (tenant_id is not None):
            raise ValueError("tenant keys need a tenant_id; admin keys must not have one")
        key_id, api_key = new_api_key()
        with self.store.transaction() as session:
            session.add(
                ApiKeyRecord(key_id=key_id, tenant_id=tenant_id, role=role, key_sha256=key_digest(api_key), label=label)
            )
        return IssuedKey(key_id=key_id, tenant_id=tenant_id, role=role, label=label, api_key=api_key)

    def verify(self, api_key: str) -> Principal | None:
        """The principal of a valid, unrevoked key; None for anything else."""
        digest = key_digest(api_key)
        if self._admin_digest is not None and hmac.compare_digest(digest, self._admin_digest):
            return Principal(ADMIN, None, "env")
        match = _KEY_RE.match(api_key)
        record = None
        if match:
            with self.store.transaction() as session:
                record = session.get(ApiKeyRecord, match.group(1))
                if record is not None:
                    session.expunge(record)
        stored = record.key_sha256 if record is not None else _DUMMY_DIGEST
        if not hmac.compare_digest(digest, stored) or record is None or record.revoked_at is not None:
            return None
        principal = Principal(record.role, record.tenant_id, record.key_id)
        self._remember(digest, principal)
        return principal

    def revoke(self, key_id: str) -> KeyInfo | None:
        with self.store.transaction() as session:
            record = session.get(ApiKeyRecord, key_id)
            if record is None:
                return None
            if record.revoked_at is None:
                record.revoked_at = utcnow()
            with self._verified_lock:
                self._verified = {d: e for d, e in self._verified.items() if e[1].key_id != key_id}
            session.flush()
            return _info(record)

    def list(self, tenant_id: str | None = None) -> list[KeyInfo]:
        query = select(ApiKeyRecord).order_by(ApiKeyRecord.created_at)
        if tenant_id is not None:
            query = query.where(ApiKeyRecord.tenant_id == tenant_id)
        with self.store.transaction() as session:
            return [_info(r) for r in session.scalars(query)]

    def has_admin_key(self) -> bool:
        with self.store.transaction() as session:
            query = select(ApiKeyRecord.key_id).where(ApiKeyRecord.role == ADMIN, ApiKeyRecord.revoked_at.is_(None))
            return session.execute(query.limit(1)).first() is not None

    def ensure_admin_key(self) -> str | None:
        """With no admin key configured (env) or stored, generate one and return it (to print
        ONCE); otherwise None. Only its hash is kept."""
        if self._admin_digest is not None or self.has_admin_key():
            return None
        return self.issue(None, role=ADMIN, label="generated at first start").api_key


def admin_key_from_env() -> str | None:
    value = os.environ.get(ADMIN_KEY_ENV, "").strip()
    if value and len(value) < 16:
        raise ValueError(f"{ADMIN_KEY_ENV} must be at least 16 characters, got {len(value)}")
    return value or None
