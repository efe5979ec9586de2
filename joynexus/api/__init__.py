"""The tenant API: the Master Service and the execution services over HTTP (paper 4.1, Fig. 4).

| module | what |
|---|---|
| `app.py` | the FastAPI server: routes of the upper and lower layer, auth dependencies |
| `gateway.py` | tenant-scoped operations behind the routes: schema checks, isolation, metering |
| `services.py` | the services it runs on: in-process objects or a Ray deployment |
| `auth.py` | API keys: random, stored hashed, constant-time verification; the admin key |
| `usage.py` | usage metering (device-seconds, samples, env steps, storage) and quotas |
| `wire.py` | tensors on the wire: dtype + shape + raw bytes (base64 in JSON, bin in msgpack) |
| `schemas.py` | request / response models, shared with `joynexus.client` |
| `errors.py`, `middleware.py` | JSON error bodies; body-size cap, idempotent replays, msgpack bodies |
| `cli.py` | `joynexus serve / tenant / workload / versions / export / usage` |

`wire` and `schemas` import neither torch nor FastAPI: the client uses them.
"""
