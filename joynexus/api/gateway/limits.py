"""The gateway's bounds on one request and on a tenant's lower-layer state."""

from __future__ import annotations

from dataclasses import dataclass

from joynexus.protocol import schemas as s
from joynexus.services.sample_slices import SAMPLE_SLICE_CHUNKS


@dataclass(frozen=True)
class ApiLimits:
    max_samples_per_request: int = s.MAX_SAMPLES_PER_REQUEST
    # Observations x n of one sampling call: each chunk is a draw (a flow head's whole Euler loop);
    # 512 x 64 ran 43 s on the Training Model Service and held other tenants' calls behind it.
    max_sampled_chunks_per_request: int = 1024
    # ... and reaches the service in slices of at most this many chunks, each its own turn beside
    # other tenants' calls and all one call holds on the service at once (joynexus.services.sample_slices).
    sample_slice_chunks: int = SAMPLE_SLICE_CHUNKS
    max_queue_bytes_per_tenant: int = 256 << 20
    max_partitions_per_tenant: int = 64
    max_string_chars: int = 4096
