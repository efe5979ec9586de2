"""Answers in the format the client asked for: JSON, or msgpack with `Accept: application/msgpack`
(tensor bytes stay raw there); a policy version's payload as safetensors bytes."""

from __future__ import annotations

from typing import Any

from fastapi import Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from joynexus.api.gateway import manifest_model
from joynexus.artifacts import TenantManifest
from joynexus.protocol import schemas as s
from joynexus.protocol.wire import MSGPACK_MEDIA_TYPE, SAFETENSORS_MEDIA_TYPE, msgpack_dumps, wants_msgpack


def respond(request: Request, model: BaseModel | list[BaseModel], status_code: int = 200) -> Response:
    """JSON, or msgpack when the client asks for it (tensor bytes stay raw there)."""
    if wants_msgpack(request.headers.get("accept")):
        data: Any = [m.model_dump() for m in model] if isinstance(model, list) else model.model_dump()
        return Response(msgpack_dumps(data), status_code=status_code, media_type=MSGPACK_MEDIA_TYPE)
    data = [m.model_dump(mode="json") for m in model] if isinstance(model, list) else model.model_dump(mode="json")
    return JSONResponse(data, status_code=status_code)


def payload_response(request: Request, payload: bytes, manifest: TenantManifest, format: str) -> Response:
    """A tenant payload: raw safetensors bytes (the manifest's version and digest in headers), or
    `ExportedParams` in JSON / msgpack."""
    if format == "json" or wants_msgpack(request.headers.get("accept")):
        exported = s.ExportedParams(version=manifest.policy_version, manifest=manifest_model(manifest), payload=payload)
        return respond(request, exported)
    filename = f"{manifest.tenant_id}-v{manifest.policy_version}.safetensors"
    return Response(
        payload,
        media_type=SAFETENSORS_MEDIA_TYPE,
        headers={
            "X-JoyNexus-Version": str(manifest.policy_version),
            "X-JoyNexus-Manifest-Digest": manifest.digest,
            "Content-Disposition": f'attachment; filename="{filename}"',
        },
    )
