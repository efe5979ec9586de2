"""Tenant artifacts: codecs (`codec`), where bytes live (`blobs`, `s3`) and the checkpoint layout
(`checkpoints`). This package alone decides how a checkpoint is laid out and found."""

from joynexus.artifacts.blobs import BlobStore, LocalBlobStore
from joynexus.artifacts.checkpoints import CheckpointStore, VersionInfo, VersionInUse
from joynexus.artifacts.codec import (
    ACTION_MODULE_FILE,
    DATASET_SHA256_KEY,
    MANIFEST_FILE,
    OBSERVATION_KEY,
    OPTIMIZER_JSON_FILE,
    OPTIMIZER_TENSORS_FILE,
    VERSION_CREATED_AT_KEY,
    CheckpointError,
    PayloadError,
    TenantManifest,
    action_module_file,
    decode_tenant_payload,
    encode_tenant_payload,
    export_manifest,
    payload_digest,
    validate_tenant_id,
)
from joynexus.artifacts.stores import blob_store_for

__all__ = [
    "ACTION_MODULE_FILE",
    "DATASET_SHA256_KEY",
    "MANIFEST_FILE",
    "OPTIMIZER_JSON_FILE",
    "OPTIMIZER_TENSORS_FILE",
    "BlobStore",
    "CheckpointError",
    "CheckpointStore",
    "LocalBlobStore",
    "PayloadError",
    "TenantManifest",
    "OBSERVATION_KEY",
    "VERSION_CREATED_AT_KEY",
    "VersionInUse",
    "VersionInfo",
    "action_module_file",
    "blob_store_for",
    "decode_tenant_payload",
    "encode_tenant_payload",
    "export_manifest",
    "payload_digest",
    "validate_tenant_id",
]
