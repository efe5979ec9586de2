"""Ray actors of a deployment: start or join Ray, create a role's named actor with its configured
resources, and typed handles that call a service the same way whether it is a local object or a
named Ray actor (`service_handle`)."""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import importlib
import inspect
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from joynexus.settings import RAY_NAMESPACE, RoleResources

HEALTH_GROUP = "health"  # the actor concurrency group that answers heartbeats
S = TypeVar("S")
R = TypeVar("R")

# The named actor each role is created as (replicas and pool workers carry a suffix of their own).
ROLE_OF_ACTOR = {
    "joynexus.master": "master",
    "joynexus.training_queue": "training_queue",
    "joynexus.training_service": "training_service",
    "joynexus.inference_service": "inference_service",
    "joynexus.environment_service": "environment_service",
}
# The execution plane's four service actors (every role but the Master), in the order the deployment
# builds and returns them: Training Queue, Training / Inference Model Service, Environment Service.
EXECUTION_PLANE_ACTORS = tuple(name for name, role in ROLE_OF_ACTOR.items() if role != "master")


def init_ray(address: str | None = None, num_cpus: int | None = None) -> None:
    """Connect to a Ray cluster, or start a local one (embedded default) if none is given."""
    import ray

    if ray.is_initialized():
        return
    # Ray 2.60 turns token auth on by default; a local embedded cluster does not need it and would
    # otherwise write ~/.ray/auth_token (STACK.md).
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if address:
        _ray_reads_the_environment()
        ray.init(address=address, namespace=RAY_NAMESPACE, log_to_driver=False)
    else:
        ray.init(
            num_cpus=num_cpus or os.cpu_count(),
            namespace=RAY_NAMESPACE,
            include_dashboard=False,
            log_to_driver=False,
            configure_logging=False,
        )


def _ray_reads_the_environment() -> None:
    """Ray reads its access settings once, at import: RAY_AUTH_MODE / RAY_AUTH_TOKEN_PATH into its
    C++ config, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER into a Python constant (off: a 127.0.0.1 address
    stays loopback instead of becoming the host's outward one). `joynexus.connect` sets them later
    for the head this data dir's `up` started (token auth, loopback: joynexus.ops.ray_access), so
    they are read again here, as Ray's own token setup does (`_enable_token_auth`)."""
    import ray._private.ray_constants as ray_constants
    from ray._raylet import Config

    if os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") == "0":
        ray_constants.ENABLE_RAY_CLUSTER = False
    Config.initialize("")


class ServiceHandle:
    """A service reached the same way whether it is a local object (tests, one process) or a named
    Ray actor (a deployment): attribute calls run the method synchronously and return its result.
    This is the one place that knows the difference ("here or on Ray"): the few things that do
    differ are asked of the handle (`probe`, `start`, `close_here`, `restarting`, `kill`,
    `constructor_argument`) instead of being branched on by its callers. Build one with
    `service_handle`, which types it as the service class (or protocol) so call sites are checked
    like direct calls."""

    __slots__ = ("_target", "_remote", "_timeout_s", "_gate")

    def __init__(self, target: Any, *, timeout_s: float | None = None):
        if isinstance(target, ServiceHandle):
            target = target._target
        if isinstance(target, ActorName):
            target = target.resolve()
        object.__setattr__(self, "_target", target)
        object.__setattr__(self, "_remote", _is_actor_handle(target))
        object.__setattr__(self, "_timeout_s", timeout_s)
        object.__setattr__(self, "_gate", None)

    def retarget(self, target: Any) -> None:
        """Point this handle at another actor of the same role (the role was looked up again: a new
        deployment, or an actor replaced under its name); every holder of the handle follows."""
        object.__setattr__(self, "_target", target)
        object.__setattr__(self, "_remote", _is_actor_handle(target))

    def set_gate(self, gate: Callable[[], None] | None) -> None:
        """`gate()` runs before every remote call and raises `RoleUnavailable` while the role cannot
        be reached (its deployment is down or being reconnected to), so no call waits on a dead Ray."""
        object.__setattr__(self, "_gate", gate)

    @property
    def is_remote(self) -> bool:
        return self._remote

    @property
    def target(self) -> Any:
        """The local object or the Ray actor handle behind this handle."""
        return self._target

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        attribute = getattr(self._target, name)
        if not self._remote:
            return attribute
        timeout_s, gate = self._timeout_s, self._gate

        def remote_call(*args: Any, **kwargs: Any) -> Any:
            import ray
            from ray.exceptions import RayTaskError

            if gate is not None:
                gate()
            try:
                return ray.get(attribute.remote(*args, **kwargs), timeout=timeout_s)
            except RayTaskError as error:  # the service's own exception, as a local call would raise it
                cause = getattr(error, "cause", None)
                if isinstance(cause, Exception):
                    raise cause from None
                raise

        remote_call.__name__ = name
        return remote_call

    def probe(self, method: str, timeout_s: float, *args: Any, wait: bool = True) -> Any:
        """Call a cheap, lock-free method (a heartbeat, a cancel) past whatever the service is busy
        with: on an actor in its own `health` concurrency group, so a long training call does not
        hide a live service; on a local SerializedService, past its lock. Raises on timeout.
        `wait` False sends it to an actor without waiting for the answer (None); a local call
        always returns its result."""
        if self._remote:
            import ray

            if self._gate is not None:
                self._gate()
            call = getattr(self._target, method)
            if not _is_client_actor_handle(self._target):  # Ray Client's options take no concurrency group:
                call = call.options(concurrency_group=HEALTH_GROUP)  # there the default group's threads answer
            ref = call.remote(*args)
            return ray.get(ref, timeout=timeout_s) if wait else None
        target = self._target.target if isinstance(self._target, SerializedService) else self._target
        return getattr(target, method)(*args)

    def start(
        self,
        method: Callable[..., R],
        *args: Any,
        locally: Callable[..., concurrent.futures.Future[R]] | None = None,
        **kwargs: Any,
    ) -> concurrent.futures.Future[R]:
        """Start `method` (given as the service class's function, e.g. `InferenceEndpoint.predict`)
        without waiting: a future of its result. On a local object, `locally` (a method of the
        service that hands out a future itself, e.g. `InferenceEndpoint.submit`, whose queue then
        batches the call) is called instead with the same arguments; without it, local calls run
        on a small shared thread pool."""
        if self._remote:
            if self._gate is not None:
                self._gate()
            return getattr(self._target, method.__name__).remote(*args, **kwargs).future()
        if locally is not None:
            return getattr(self._target, locally.__name__)(*args, **kwargs)
        return _local_pool().submit(getattr(self._target, method.__name__), *args, **kwargs)

    # -- what differs between a local object and an actor, asked here rather than branched on ------
    def close_here(self, method: str = "close") -> bool:
        """Stop a service that lives in this process by calling its `method` (True); a Ray actor's
        life is its cluster's, so nothing is called (False)."""
        if self._remote:
            return False
        getattr(self._target, method)()
        return True

    def restarting(self) -> bool:
        """Whether Ray is (re)building the actor: not ALIVE yet (pending creation, restarting; its
        constructor has not returned), read from the GCS actor table; an error counts as not
        restarting. A local object never restarts on its own."""
        if not self._remote:
            return False
        try:
            from ray._private.state import state

            return state.actor_table(self._target._actor_id.hex()).get("State") not in ("ALIVE", "DEAD", None)
        except Exception:
            return False

    @property
    def restartable_in_place(self) -> bool:
        """Whether the service can be restarted alone, in place: an actor can (Ray's `max_restarts`),
        a local object cannot (it lives and dies with this process)."""
        return self._remote

    def kill(self, *, restart: bool) -> bool:
        """End the actor's process (True): with `restart`, Ray's `max_restarts` starts it again in
        place (a hung role); without, it is gone for good (a fenced shard). A local object cannot be
        ended alone (False: nothing is done)."""
        if not self._remote:
            return False
        import ray

        ray.kill(self._target, no_restart=not restart)
        return True

    def constructor_argument(self, name: str, namespace: str | None = None) -> Any:
        """The service as another service's constructor takes it: an actor BY NAME (`ActorName`:
        each new life of the receiving actor looks it up again), a local object as itself."""
        return ActorName(name, namespace) if self._remote else self._target

    def __reduce__(self) -> tuple[Any, ...]:  # a Ray actor handle travels to other Ray processes
        return (ServiceHandle, (self._target,), None)

    def __repr__(self) -> str:
        return f"ServiceHandle({type(self._target).__name__}, remote={self._remote})"


class _ArrivalOrderLock:
    """A reentrant lock granted in arrival order, as a Ray actor takes its calls: a thread that
    releases it and asks again goes behind the threads already waiting (Python's RLock lets it
    take the lock straight back, so a caller in a loop, such as a sampling call's slices, could
    keep every other tenant's call waiting; issue 41.1)."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._owner: int | None = None
        self._depth = 0
        self._waiting: collections.deque[object] = collections.deque()

    def __enter__(self) -> None:
        me = threading.get_ident()
        with self._cond:
            if self._owner == me:
                self._depth += 1
                return
            if self._owner is None and not self._waiting:
                self._owner, self._depth = me, 1
                return
            ticket = object()
            self._waiting.append(ticket)
            try:
                while not (self._owner is None and self._waiting[0] is ticket):
                    self._cond.wait()
            except BaseException:
                self._waiting.remove(ticket)
                self._cond.notify_all()
                raise
            self._waiting.popleft()
            self._owner, self._depth = me, 1

    def __exit__(self, *exc: object) -> None:
        with self._cond:
            self._depth -= 1
            if self._depth == 0:
                self._owner = None
                self._cond.notify_all()


class SerializedService:
    """A local service object behind a lock: one method call at a time, in arrival order, like a
    Ray actor (the Training Model Service in one process is called from the actor loop and API threads)."""

    def __init__(self, target: Any):
        self._target = target
        self._lock = _ArrivalOrderLock()

    @property
    def target(self) -> Any:
        return self._target

    def call_timed(self, method: str, *args: Any, **kwargs: Any) -> tuple[Any, float]:
        """(result, seconds the method itself ran), not counting the wait for the lock."""
        with self._lock:
            started = time.perf_counter()
            result = getattr(self._target, method)(*args, **kwargs)
            return result, time.perf_counter() - started

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._target, name)
        if not callable(attribute):
            return attribute

        def locked(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                return attribute(*args, **kwargs)

        return locked


@dataclass(frozen=True)
class ActorName:
    """A named actor passed BY NAME to another actor's constructor: a handle argument is owned by
    the driver that created it, and Ray may fail to restart an actor whose argument's owner exited
    (a `joynexus up` driver exits at once); a name is looked up again by every new life."""

    name: str
    namespace: str | None = None

    def resolve(self) -> Any:
        import ray

        return ray.get_actor(self.name, namespace=self.namespace)


def service_handle(cls: type[S], target: Any, *, timeout_s: float | None = None) -> S:
    """`target` (an instance of `cls` or a Ray actor of it) behind a ServiceHandle, typed as `cls`."""
    if isinstance(target, ServiceHandle):
        return cast(S, target)
    return cast(S, ServiceHandle(target, timeout_s=timeout_s))


def handle_of(service: Any) -> ServiceHandle:
    """The ServiceHandle behind a value `service_handle` returned (or a new one around a raw target)."""
    return service if isinstance(service, ServiceHandle) else ServiceHandle(service)


def _is_actor_handle(target: Any) -> bool:
    try:
        from ray.actor import ActorHandle
        from ray.util.client.common import ClientActorHandle
    except ImportError:  # pragma: no cover - ray is a hard dependency
        return False
    # A driver connected through the Ray Client (ray://head:10001, as a pod outside the cluster)
    # holds ClientActorHandles: the same calls, a different class.
    return isinstance(target, ActorHandle | ClientActorHandle)


def _is_client_actor_handle(target: Any) -> bool:
    from ray.util.client.common import ClientActorHandle

    return isinstance(target, ClientActorHandle)


@functools.cache
def _local_pool() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(max_workers=32, thread_name_prefix="service-call")


class ActorShell:
    """The class Ray knows a role's actor by: a thin stand-in made by `actor_class`, with one
    forwarding method per method of the service class, which it imports and builds only in the
    actor's own process (`__init__`).

    Why: a driver that looks an actor up (`ray.get_actor`) loads the actor's class to learn its
    methods. Were that the service class itself, pickled by reference, every `joynexus status`,
    `down` or client would import the service's module and with it torch and transformers
    (30-60 s on a small machine) just to send a heartbeat. The stand-in travels by value and
    needs nothing but this module."""

    _shell_of: tuple[str, str] = ("", "")  # (module, qualified name) of the service class

    def __init__(self, *args: Any, **kwargs: Any):
        module_name, qualname = self._shell_of
        target: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            target = getattr(target, part)
        self._shell_target = target(*args, **kwargs)


def _forwarding(name: str, generator: bool) -> Callable[..., Any]:
    if generator:  # Ray streams a generator method's items: so must its stand-in

        def forward_items(self: ActorShell, *args: Any, **kwargs: Any) -> Any:
            yield from getattr(self._shell_target, name)(*args, **kwargs)

        method = forward_items
    else:

        def forward(self: ActorShell, *args: Any, **kwargs: Any) -> Any:
            return getattr(self._shell_target, name)(*args, **kwargs)

        method = forward
    method.__name__ = method.__qualname__ = name
    return method


@functools.cache
def actor_class(cls: type) -> type:
    """The `ActorShell` Ray creates `cls`'s actors from: same class name (Ray's state shows it),
    the same public and private methods (dunders aside), each calling the instance of `cls` the
    actor built. Call sites and results are unchanged; only the driver's lookup gets cheap."""
    methods = {
        name: _forwarding(name, inspect.isgeneratorfunction(member))
        for name, member in inspect.getmembers(cls, predicate=lambda m: inspect.isfunction(m) or inspect.ismethod(m))
        if not (name.startswith("__") and name.endswith("__")) and not hasattr(ActorShell, name)
    }
    # Named after `cls` but not findable under that name here, so cloudpickle ships it by value.
    namespace = {**methods, "__module__": __name__, "__qualname__": cls.__qualname__, "__doc__": cls.__doc__}
    return type(cls.__name__, (ActorShell,), {**namespace, "_shell_of": (cls.__module__, cls.__qualname__)})


_placement: dict[str, RoleResources] = {}
_placement_lock = threading.Lock()


def configure_placement(resources: dict[str, RoleResources]) -> None:
    """The deployment's resources per role, for every actor this process creates from now on
    (`create_service_actors` sets it from `Settings.resources`; the service factories then need no
    parameter of their own)."""
    with _placement_lock:
        _placement.clear()
        _placement.update(resources)


def role_resources(role: str) -> RoleResources:
    """The configured resources of `role` (an empty spec: the role's defaults)."""
    with _placement_lock:
        return _placement.get(role, RoleResources())


def named_actor(
    cls: type,
    name: str,
    *args: Any,
    namespace: str | None = None,
    detached: bool = False,
    num_cpus: float = 0,
    max_concurrency: int = 1,
    max_restarts: int = -1,
    role: str | None = None,
    ray_resources: RoleResources | None = None,
    get_if_exists: bool = True,
    scheduling_strategy: str | None = None,
    **kwargs: Any,
) -> Any:
    """Get the deployment's named actor of `cls`, creating it from `args` / `kwargs` if absent
    (Ray must be initialized). A running actor is reused as it is, so nothing is rebuilt;
    `detached` actors outlive the driver that created them (`joynexus up`).

    A role that dies is restarted in place by Ray (`max_restarts`, -1: always) with the same
    arguments; the Master's Health Manager then restores what it held (paper 4.4). Every actor has
    a one-thread `health` concurrency group, so heartbeats are answered while it is busy.

    Resources: the configured `RoleResources` of `role` (default: the role the actor name stands
    for, `ROLE_OF_ACTOR`), or an explicit `ray_resources`, replace `num_cpus` where set and add GPUs,
    memory and custom resources."""
    import ray

    role = role or ROLE_OF_ACTOR.get(name)
    if ray_resources is None:
        ray_resources = role_resources(role) if role else RoleResources()
    return (
        ray.remote(concurrency_groups={HEALTH_GROUP: 1})(actor_class(cls))  # not an .options() setting in Ray
        .options(
            name=name,
            namespace=namespace,
            get_if_exists=get_if_exists,
            max_concurrency=max_concurrency,
            max_restarts=max_restarts,
            lifetime="detached" if detached else None,
            **ray_resources.ray_options(default_num_cpus=num_cpus),
            **({"scheduling_strategy": scheduling_strategy} if scheduling_strategy else {}),
        )
        .remote(*args, **kwargs)
    )


class RoleUnavailable(RuntimeError):
    """A role (the Master, a service, or the Ray cluster under them) is away: restarting in place,
    or being replaced by a new deployment. Not the call's fault: the caller may retry after
    `retry_after_s` (the tenant API answers 503 with `Retry-After`)."""

    def __init__(self, role: str, reason: str, retry_after_s: float = 2.0):
        self.role, self.reason, self.retry_after_s = role, reason, retry_after_s
        super().__init__(f"{role} is unavailable: {reason}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.role, self.reason, self.retry_after_s))


SERVICES_CREATOR = (
    "`joynexus up` creates them (on Kubernetes: the Job joynexus-services, deployments/ray/services-job.yaml; "
    "`kubectl -n joynexus get job joynexus-services`)"
)


class ServicesNotRunning(RoleUnavailable):
    """A deployment's named service actors are not running at its Ray address. Clients never create
    them (they would live only as long as the client): they wait, then raise this (503 in the API,
    whose message names what creates them)."""

    @property
    def client_message(self) -> str:
        return str(self)


def running_actor(name: str, namespace: str | None, role: str) -> Any:
    """A deployment's named actor, looked up (Ray initialized): a client never creates one (it would
    live only as long as the client); absent, `ServicesNotRunning` names what creates it."""
    import ray

    try:
        return ray.get_actor(name, namespace=namespace)
    except ValueError:
        raise ServicesNotRunning(
            role, f"{name} is not running (namespace {namespace}); clients do not create it: {SERVICES_CREATOR}", 10.0
        ) from None


def role_unavailable_errors() -> tuple[type[BaseException], ...]:
    """The exception classes that mean a role is away (`role_unavailable`), for handlers by class."""
    try:
        from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
    except ImportError:  # pragma: no cover - ray is a hard dependency
        return (RoleUnavailable,)
    return (RoleUnavailable, RayActorError, ActorDiedError, ActorUnavailableError)


def role_unavailable(error: BaseException) -> bool:
    """True for errors that mean the service behind a handle is gone or restarting (its calls
    fail until it is back), not that the call itself was wrong: callers retry or re-queue."""
    return isinstance(error, role_unavailable_errors())
