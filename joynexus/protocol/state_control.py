"""Request and response models of state control (issue 28.3): `load_state` rolls the caller's
training slot back to a kept version; `fork` makes a new tenant from one of the caller's versions
with another learning rate or seed (same schema, same module)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from joynexus.protocol.schemas import IssuedKey, TenantInfo

TENANT_ID_PATTERN = r"^[a-z0-9][a-z0-9._-]{0,62}$"  # as `joynexus.spec`
MAX_TRAINING_SEED = 2**64 - 1  # as `joynexus.spec`


class LoadStateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: int = Field(ge=0, le=2**31, description="a kept checkpoint version of your tenant")


class LoadStateResult(BaseModel):
    model_config = ConfigDict(extra="ignore")

    version: int  # the version the slot now holds
    previous_version: int
    optimizer_restored: bool  # False: that checkpoint had no optimizer state; AdamW starts afresh
    optimizer_steps: int
    discarded_microbatches: int  # pending forward_backward gradients dropped by the rollback


class ForkOverrides(BaseModel):
    """What the new tenant changes; everything else (schema, module, adapter, data) is the source's."""

    model_config = ConfigDict(extra="forbid")

    learning_rate: float | None = Field(default=None, gt=0, le=1)
    seed: int | None = Field(default=None, ge=0, le=MAX_TRAINING_SEED)


class ForkRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    new_tenant: str = Field(pattern=TENANT_ID_PATTERN, description="the new tenant's id")
    version: int | None = Field(
        default=None, ge=0, le=2**31, description="a kept checkpoint version; None: the current training version"
    )
    overrides: ForkOverrides = ForkOverrides()


class ForkedFrom(BaseModel):
    model_config = ConfigDict(extra="ignore")

    tenant_id: str
    version: int


class TenantForked(BaseModel):
    """The new tenant, its first API key (shown only here) and where its weights came from."""

    model_config = ConfigDict(extra="ignore")

    tenant: TenantInfo
    key: IssuedKey | None = None
    forked_from: ForkedFrom
    version: int  # the new tenant's version holding the forked weights (0)
    owner: str | None = None  # the tenant whose quotas the fork counts against (GET /v1/forks lists it)


class ForkInfo(BaseModel):
    """A fork the caller owns (GET /v1/forks): made from `source_tenant_id` at `source_version`."""

    model_config = ConfigDict(extra="ignore")

    tenant_id: str
    source_tenant_id: str
    source_version: int
    created_at: float  # unix seconds


class ForkList(BaseModel):
    model_config = ConfigDict(extra="ignore")

    forks: list[ForkInfo]
    max_forks: int | None = None  # how many forks the caller may own (max_forks_per_tenant)
