"""One in-process API world for the whole tests/api session: every service a local object
(`joynexus.connect.in_process`: SQLite store, local MLflow, tiny backbone) under a FastAPI TestClient.

Tests create their own tenants (unique names) so they never depend on each other's state.
"""

from __future__ import annotations

import itertools
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.helpers import sft_spec, write_dataset_for

ADMIN_KEY = "test-admin-key-0123456789abcdef"
MAX_BODY_BYTES = 4 << 20

# Two schemas: camera sets, image sizes, state/action dims, chunk lengths and module kinds differ.
SHAPES: dict[str, dict[str, Any]] = {
    "arm": dict(cameras=("front", "wrist"), image_size=(32, 32), state_dim=4, action_dim=3, action_chunk=2),
    "flow": dict(
        cameras=("top",), image_size=(24, 40), state_dim=6, action_dim=5, action_chunk=4, module="flow_matching"
    ),
}
_names = itertools.count(1)


@dataclass
class TenantHandle:
    tenant_id: str
    api_key: str
    spec: dict[str, Any]

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    def batch(self, n: int = 4, seed: int = 0) -> dict[str, np.ndarray]:
        return sample_batch(self.spec, n, seed)


@dataclass
class ApiWorld:
    app: Any
    client: Any
    cluster: Any  # joynexus.connect.Cluster: the services and the Master, in this process
    data_dir: Path
    _datasets: dict[str, Path] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def admin(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {ADMIN_KEY}"}

    def spec(self, prefix: str, shape: str = "arm", **overrides: Any) -> dict[str, Any]:
        tenant_id = f"{prefix}-{next(_names)}"
        with self._lock:
            root = self._datasets.get(shape)
            if root is None:
                spec = sft_spec(shape, self.data_dir / "datasets" / shape, **SHAPES[shape])
                write_dataset_for(spec, episodes=2, length=12)
                root = self._datasets[shape] = Path(spec["dataset"]["root"])
        spec = sft_spec(tenant_id, root, **{**SHAPES[shape], "jobs": 2, **overrides})
        spec["dataset"]["repo_id"] = f"test/{shape}"
        return spec

    def tenant(self, prefix: str, shape: str = "arm", **overrides: Any) -> TenantHandle:
        spec = self.spec(prefix, shape, **overrides)
        response = self.client.post("/v1/admin/tenants", json=spec, headers=self.admin)
        assert response.status_code == 201, response.text
        return TenantHandle(spec["tenant"], response.json()["key"]["api_key"], spec)


def sample_batch(spec: dict[str, Any], n: int, seed: int) -> dict[str, np.ndarray]:
    """Samples of the spec's schema (actions a fixed function of state: a learnable target)."""
    obs = spec["observation"]
    rng = np.random.default_rng(seed)
    height, width = obs["image_size"]
    state = rng.standard_normal((n, obs["state_dim"])).astype(np.float32)
    action = np.tanh(rng.standard_normal((n, obs["action_chunk"], obs["action_dim"]))).astype(np.float32)
    return {
        "images": rng.random((n, len(obs["cameras"]), 3, height, width), dtype=np.float32),
        "state": state,
        "action": action,
    }


def wire(batch: dict[str, Any]) -> dict[str, Any]:
    """A batch as the JSON body of a lower-layer request (tensors as wire objects)."""
    from joynexus.protocol.wire import tensor

    return {k: tensor(v).model_dump(mode="json") if isinstance(v, np.ndarray) else v for k, v in batch.items()}


@pytest.fixture(scope="session")
def api(tmp_path_factory) -> ApiWorld:
    from fastapi.testclient import TestClient

    from joynexus.api.app import ApiSettings, create_app
    from joynexus.connect import in_process
    from joynexus.master.service import MasterOptions
    from joynexus.settings import Settings

    data_dir = tmp_path_factory.mktemp("api")
    cluster = in_process(Settings(data_dir=data_dir), options=MasterOptions(default_max_queued_workloads=3))
    settings = ApiSettings(max_body_bytes=MAX_BODY_BYTES, default_max_queued_workloads=3, stream_poll_s=0.05)
    app = create_app(cluster, settings, admin_key=ADMIN_KEY)
    # raise_server_exceptions=False: a 500 comes back as the client would see it (no traceback).
    with TestClient(app, raise_server_exceptions=False) as client:
        yield ApiWorld(app, client, cluster, data_dir)
    cluster.close()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def live_server(api: ApiWorld) -> str:
    """The same app behind a real uvicorn server on a free port of 127.0.0.1; yields its URL."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(api.app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=30)


def pytest_configure(config) -> None:
    # starlette's TestClient warns that it will move to httpx2; nothing to act on here.
    config.addinivalue_line("filterwarnings", "ignore:Using `httpx` with `starlette.testclient`")
