"""What the routes depend on (`Depends`): the caller (from its bearer key), its tenant or the admin
role, the gateway and key store of the app (`app.state`), the typed path parameters, and the error
answers every route documents."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Depends, Path, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from joynexus.api.auth import ApiKeyStore, Principal
from joynexus.api.errors import Forbidden, Unauthenticated
from joynexus.api.gateway import ApiGateway
from joynexus.api.middleware import PRINCIPAL_SCOPE_KEY
from joynexus.protocol import schemas as s

_bearer = HTTPBearer(auto_error=False, description="`Authorization: Bearer <API key>`")


# The dependencies that do no I/O are `async def`: FastAPI runs a sync one in the shared worker
# thread pool, and a hop there per request is a wait behind whatever fills that pool.
async def gateway_of(request: Request) -> ApiGateway:
    return request.app.state.gateway


async def keys_of(request: Request) -> ApiKeyStore:
    return request.app.state.keys


async def principal(
    request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> Principal:
    """The caller its bearer key stands for (401 without a valid one). A key verified moments ago
    costs no thread; otherwise the store is read in a worker thread."""
    if credentials is None:
        raise Unauthenticated("missing API key: send 'Authorization: Bearer <key>'")
    verified = request.scope.get("state", {}).get(PRINCIPAL_SCOPE_KEY)  # by IdempotencyMiddleware
    if verified is not None and verified[0] == credentials.credentials:
        return verified[1]
    keys: ApiKeyStore = request.app.state.keys
    found = await keys.authenticate(credentials.credentials)
    if found is None:
        raise Unauthenticated("invalid or revoked API key")
    return found


async def tenant_scope(caller: Annotated[Principal, Depends(principal)]) -> str:
    """The caller's tenant id (403 for the admin key, which has no tenant)."""
    if caller.tenant_id is None:
        raise Forbidden("this endpoint acts on a tenant's own resources: call it with that tenant's API key")
    return caller.tenant_id


async def admin_only(caller: Annotated[Principal, Depends(principal)]) -> Principal:
    if not caller.is_admin:
        raise Forbidden("this endpoint needs the admin key")
    return caller


Gateway = Annotated[ApiGateway, Depends(gateway_of)]
Keys = Annotated[ApiKeyStore, Depends(keys_of)]
Tenant = Annotated[str, Depends(tenant_scope)]
Admin = Annotated[Principal, Depends(admin_only)]
WorkloadId = Annotated[str, Path(max_length=64, description="a workload id of your tenant")]
Version = Annotated[int, Path(ge=0, le=2**31, description="a policy version of your tenant")]
PartitionName = Annotated[str, Path(pattern=s.PARTITION_NAME_PATTERN, description="a partition of your tenant")]
SessionId = Annotated[str, Path(pattern=s.SESSION_ID_PATTERN, description="an environment session of yours")]
TenantIdPath = Annotated[str, Path(max_length=64, description="a tenant id")]

ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": s.ErrorBody, "description": text}
    for code, text in (
        (401, "missing or invalid API key"),
        (404, "no such resource in the caller's tenant (another tenant's id answers the same)"),
        (413, "request body over the size limit"),
        (422, "invalid input: each problem names the field and the reason"),
        (429, "a quota or rate limit stops this: the message says which (rate limits add Retry-After)"),
    )
}
ADMIN_ERRORS: dict[int | str, dict[str, Any]] = {
    **ERRORS,
    403: {"model": s.ErrorBody, "description": "needs the admin key"},
}
