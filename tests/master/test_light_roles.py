"""The roles that never run a model start without the model stack (issue 30): `joynexus up` builds
six actor processes at once on a small machine, and each one's imports count. The Master, the
futures call queue, the Training Queue and the Environment Service import neither torch nor
transformers (nor sklearn, peft; the light ones not MLflow, pandas or scipy either). The Master
reaches the execution plane's running actors by name: it imports the service classes (and torch)
only to create a missing one."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

MODEL_STACK = ("torch", "torchvision", "transformers", "sklearn", "peft")
# The Master keeps MLflow (its experiment tracker opens when it is built), which brings pandas and scipy.
LIGHT = (*MODEL_STACK, "mlflow", "pandas", "scipy")

ROLES = {
    "joynexus.master.service": MODEL_STACK,  # Master
    "joynexus.services.call_futures": LIGHT,  # futures call queue
    "joynexus.scheduling.training_queue": LIGHT,  # Training Queue
    "joynexus.services.environment.service": LIGHT,  # Environment Service
}


def _imported(code: str, *args: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("module", sorted(ROLES))
def test_a_role_that_runs_no_model_imports_no_model_stack(module):
    heavy = ROLES[module]
    code = (
        f"import importlib, json, sys; importlib.import_module({module!r}); "
        f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {set(heavy)!r})))"
    )
    assert _imported(code) == []


# The Master's `Deployment.start` over a Ray whose four service actors run: Ray answers every lookup.
RUNNING_SERVICES = """
import json, sys
from pathlib import Path
import ray
import joynexus.master.deployment as deployment
from joynexus.settings import Settings

ray.is_initialized = lambda: True
ray.get_actor = lambda name, namespace=None: f"actor:{name}"
found = deployment.create_service_actors(Settings(data_dir=Path(sys.argv[1])), detached=True)
assert found == tuple(f"actor:{name}" for name in deployment.SERVICE_ACTORS), found
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers")
                        or m == "joynexus.services.configs")))
"""


def test_running_service_actors_are_looked_up_without_importing_the_services(tmp_path):
    assert _imported(RUNNING_SERVICES, str(tmp_path)) == []
