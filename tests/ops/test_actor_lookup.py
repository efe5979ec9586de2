"""Looking a deployment's actor up is cheap (issue 30): a driver that gets a role's named actor
(`joynexus status`, `down`, a client) loads the class Ray created it from, and that class is the
role's `ActorShell` (`joynexus.actors.actor_class`), shipped by value: the driver imports neither
the service's module nor torch, transformers or MLflow. The actor itself builds the real service."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid

import pytest

from joynexus.actors import actor_class, named_actor

ray = pytest.importorskip("ray")

HEAVY = ("torch", "transformers", "mlflow", "peft")

# What `ray.get_actor` does to the class it finds: unpickle what Ray shipped, in a fresh interpreter.
LOAD = """
import base64, json, pickle, sys
classes = {name: pickle.loads(base64.b64decode(data)) for name, data in json.loads(sys.stdin.read()).items()}
print(json.dumps({
    "methods": {name: sorted(k for k in vars(cls) if callable(vars(cls)[k])) for name, cls in classes.items()},
    "class_names": {name: cls.__name__ for name, cls in classes.items()},
    "imported": sorted(m for m in sys.modules if m.split(".")[0] in {heavy} or m.startswith(
        ("joynexus.master", "joynexus.services", "joynexus.scheduling", "joynexus.models"))),
}))
"""


def _role_classes() -> dict[str, type]:
    from joynexus.master.service import MasterService
    from joynexus.scheduling.training_queue import TrainingQueue
    from joynexus.services.call_futures import CallFutures
    from joynexus.services.environment.service import EnvironmentPool, EnvironmentService
    from joynexus.services.inference.replicas import InferenceReplicaSet
    from joynexus.services.inference.service import InferenceModelService
    from joynexus.services.training.service import TrainingModelService

    classes = (MasterService, TrainingQueue, CallFutures, EnvironmentPool, EnvironmentService)
    return {cls.__name__: cls for cls in (*classes, InferenceReplicaSet, InferenceModelService, TrainingModelService)}


def test_every_role_class_reaches_a_fresh_driver_without_its_module_or_torch():
    import base64

    from ray import cloudpickle

    classes = _role_classes()
    shipped = {name: base64.b64encode(cloudpickle.dumps(actor_class(cls))).decode() for name, cls in classes.items()}
    code = LOAD.replace("{heavy}", repr(set(HEAVY)))
    done = subprocess.run(
        [sys.executable, "-c", code], input=json.dumps(shipped), capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    loaded = json.loads(done.stdout)
    assert loaded["imported"] == []
    assert loaded["class_names"] == {name: name for name in classes}  # Ray's state shows the role's class
    for name, cls in classes.items():
        expected = {m for m in vars(actor_class(cls)) if callable(vars(actor_class(cls))[m])}
        assert set(loaded["methods"][name]) == expected
        public = {m for m in dir(cls) if not m.startswith("_") and callable(getattr(cls, m))}
        assert public <= set(loaded["methods"][name]), public - set(loaded["methods"][name])


def test_a_shell_forwards_calls_results_and_errors_to_the_service_it_builds():
    from joynexus.scheduling.training_queue import TrainingQueue, TrainingQueueError

    shell = actor_class(TrainingQueue)()
    assert shell.partitions() == [] and shell.has_partition("p") is False
    assert isinstance(shell._shell_target, TrainingQueue)
    with pytest.raises(TrainingQueueError, match="clear_prefix needs a non-empty prefix"):
        shell.clear_prefix("")  # the service's own error, as a direct call raises it
    with pytest.raises(TypeError):
        shell.partitions("unexpected")


# A second driver, as `joynexus status` is: look the actor up by name and call it.
LOOKUP = """
import json, sys
from joynexus.actors import init_ray, service_handle
init_ray(sys.argv[1])
import ray
queue = service_handle(object, ray.get_actor("joynexus.training_queue", namespace=sys.argv[2]))
print(json.dumps({"partitions": queue.partitions(), "imported": sorted(m for m in sys.modules if m.startswith(
    ("joynexus.scheduling", "torch")))}))
"""


def test_a_driver_that_looks_a_named_actor_up_does_not_import_its_service_module():
    from joynexus.actors import init_ray
    from joynexus.scheduling.training_queue import TrainingQueue

    started = not ray.is_initialized()
    init_ray(num_cpus=1)
    namespace = f"lookup-{uuid.uuid4().hex[:8]}"
    actor = named_actor(TrainingQueue, "joynexus.training_queue", namespace=namespace)
    try:
        assert ray.get(actor.partitions.remote(), timeout=120) == []
        address = ray.get_runtime_context().gcs_address
        done = subprocess.run(
            [sys.executable, "-c", LOOKUP, address, namespace], capture_output=True, text=True, timeout=180
        )
        assert done.returncode == 0, done.stderr[-3000:]
        assert json.loads(done.stdout.strip().splitlines()[-1]) == {"partitions": [], "imported": []}
    finally:
        ray.kill(actor, no_restart=True)
        if started:
            ray.shutdown()


def test_the_modules_a_client_of_a_running_deployment_imports_do_not_import_torch():
    """`joynexus status` / `down` and the flows connect through these; the services import torch."""
    code = (
        "import sys, joynexus.actors, joynexus.connect, joynexus.ops.supervisor, joynexus.cli\n"
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {set(HEAVY)!r}))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[]"
