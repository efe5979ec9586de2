"""The tenant API's routes, one `APIRouter` per concern; `joynexus.api.app.create_app` includes them.

| module | routes |
|---|---|
| `meta.py` | /v1/health, /metrics |
| `admin.py` | /v1/admin: tenants, API keys, quotas, usage (admin key) |
| `upper.py` | the caller's tenant, workloads, versions and exports, manifests, usage |
| `stream.py` | a workload's events as Server-Sent Events |
| `lower.py` | training primitives, load_weights, predict, Training Queue, environment sessions |
| `foreign.py` | foreign weights install (tenant, admin), evaluation declarations |
| `dependencies.py`, `responses.py` | auth and app-state dependencies, path types; JSON / msgpack answers |

Every route reads what it needs from `request.app.state` through `Depends` (`dependencies.py`).
"""
