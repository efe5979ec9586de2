"""Environment Service (paper 4.1.2, 4.2): session-based reset / step / close over simulators.

Each session belongs to one tenant and one rollout and runs its simulator in its OWN worker
process (multiprocessing "spawn": no inherited locks, threads or file descriptors; one env per
process, as ManiSkill on the CPU requires). Parent and worker talk over a Pipe with a small
JSON + raw-buffer codec that carries only plain data and numpy arrays of numeric dtypes: nothing
is ever unpickled from a worker, and nothing a client sends reaches a worker except a validated
config and validated actions.

Failure isolation: a worker that dies (crash, segfault, SIGKILL) or hangs past the timeout fails
only its own session with `SessionFailed(session_id, reason)`; the process is killed and reaped and
the slot freed. Other sessions and the service keep working. A simulator *exception* (as opposed
to a dead worker) is reported to the caller and the session stays usable.

Tenant isolation: a session id is usable only by its owning tenant. Another tenant's id raises the
same `UnknownSession` as an id that never existed, so ids do not leak across tenants.

Deployed as a named Ray actor (`services.configs.EnvironmentServiceConfig.actor`) with max_concurrency, so several
tenants' calls run side by side (each session has its own lock; the session table has one).

The package: `errors.py`, `worker.py` (the worker process and its codec), `sessions.py`
(`EnvironmentService`), `pool.py` (`EnvironmentPool` and its worker factories). This module
gathers the names a deployment uses.
"""

from joynexus.services.environment.errors import (
    EnvironmentServiceError,
    SessionFailed,
    SessionLimitExceeded,
    SimulatorError,
    UnknownSession,
)
from joynexus.services.environment.pool import (
    EnvironmentPool,
    EnvironmentWorkerFactory,
    LocalEnvironmentWorkers,
    RayEnvironmentWorkers,
)
from joynexus.services.environment.sessions import (
    ENVIRONMENT_SERVICE_ACTOR_NAME,
    EnvironmentService,
)

__all__ = [
    "ENVIRONMENT_SERVICE_ACTOR_NAME",
    "EnvironmentPool",
    "EnvironmentService",
    "EnvironmentServiceError",
    "EnvironmentWorkerFactory",
    "LocalEnvironmentWorkers",
    "RayEnvironmentWorkers",
    "SessionFailed",
    "SessionLimitExceeded",
    "SimulatorError",
    "UnknownSession",
]
