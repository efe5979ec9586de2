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

import hashlib
import hmac
import os
import re
import secrets
from dataclasses import dataclass

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


class ApiKeyStore:
    """API keys in the control-plane store (table `api_keys`)."""

    def __init__(self, store: ControlPlaneStore, admin_key: str | None = None):
        self.store = store
        self._admin_digest = key_digest(admin_key) if admin_key else None

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
        return Principal(record.role, record.tenant_id, record.key_id)

    def revoke(self, key_id: str) -> KeyInfo | None:
        with self.store.transaction() as session:
            record = session.get(ApiKeyRecord, key_id)
            if record is None:
                return None
            if record.revoked_at is None:
                record.revoked_at = utcnow()
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
