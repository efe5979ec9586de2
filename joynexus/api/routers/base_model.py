"""``GET /v1/base_model``: the deployment's base model checkpoint (a tar), so an export of any
tenant version runs outside JoyNexus (the LeRobot plugin, stock peft) with the exact backbone it
was trained on."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import FileResponse

from joynexus.api.routers.dependencies import ERRORS, Gateway, Tenant
from joynexus.artifacts.base_model import BASE_MODEL_MEDIA_TYPE, base_model_archive

router = APIRouter(prefix="/v1", tags=["upper layer"], responses=ERRORS)


@router.get(
    "/base_model",
    response_class=FileResponse,
    responses={200: {"content": {BASE_MODEL_MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}}}}},
)
def base_model(tenant_id: Tenant, gateway: Gateway) -> FileResponse:
    """The base model the caller's tenant runs on, as an uncompressed tar of its checkpoint
    directory (config.json, safetensors weights, tokenizer, processor); built once, then cached.
    Unpack with `joynexus.artifacts.base_model.extract_base_model`."""
    from joynexus.services.configs import backbone_source  # the services' modules (torch): not at start

    settings = gateway.cluster.settings
    archive = base_model_archive(backbone_source(settings), settings.data_dir / "base_model")
    return FileResponse(archive, media_type=BASE_MODEL_MEDIA_TYPE, filename="base_model.tar")
