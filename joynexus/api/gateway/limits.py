"""The gateway's bounds on one request and on a tenant's lower-layer state."""

from __future__ import annotations

from dataclasses import dataclass

from joynexus.protocol import schemas as s


@dataclass(frozen=True)
class ApiLimits:
    max_samples_per_request: int = s.MAX_SAMPLES_PER_REQUEST
    # Observations x n of one sampling call: each chunk is a draw (a flow head's whole Euler loop);
    # 512 x 64 ran 43 s on the Training Model Service and held other tenants' calls behind it.
    max_sampled_chunks_per_request: int = 1024
    max_queue_bytes_per_tenant: int = 256 << 20
    max_partitions_per_tenant: int = 64
    max_string_chars: int = 4096
