"""The tenant API: the Master Service and the execution services over HTTP (paper 4.1, Fig. 4).

| module | what |
|---|---|
| `app.py` | `create_app`: the FastAPI app over a `joynexus.connect.Cluster`, its middleware and routers |
| `settings.py` | `ApiSettings` (quota defaults are the Master's) |
| `routers/` | one `APIRouter` per concern: meta, admin, upper layer, workload event stream, lower layer |
| `gateway/` | tenant-scoped operations behind the routes: schema checks, isolation, metering, per concern |
| `auth.py` | API keys: random, stored hashed, constant-time verification; the admin key |
| `streaming.py` | the robots' policy stream (/v1/stream, websocket) |
| `errors.py`, `middleware.py` | JSON error bodies; body-size cap, idempotent replays, msgpack bodies |
| `cli.py` | `joynexus serve / tenant / workload / versions / export / usage` |
| `rate_limits.py` | per-tenant token buckets, in-flight bound, worker threads of its own (429 + Retry-After) |
| `priority_gate.py` | lower-layer training calls admitted to the Training Model Service by tenant priority |

Request / response models and the wire format are in `joynexus.protocol` (shared with `joynexus.client`),
usage metering and quotas in `joynexus.master.usage`.
"""
