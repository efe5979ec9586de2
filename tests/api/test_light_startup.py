"""`joynexus serve` starts without the model stack (issue 30): the API server is a client of the
services, so importing it and building its app import neither torch nor transformers (nor MLflow,
peft, pandas). The service exceptions the gateway maps to API errors, the Master's options and the
loss names live in light modules (`services/*/errors.py`, `master/errors.py`, `master/options.py`,
`algorithms/loss_names.py`); what needs torch (checking a payload's tensors, building a preset's
base-model archive, validating an uploaded dataset) imports it when it runs."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("torch", "transformers", "mlflow", "peft", "pandas")

# What `joynexus serve` imports before it connects, then the app it builds over a deployment's
# handles (Ray mode: the role follower too), with its store and checkpoint store opened.
SERVE = """
import json, sys
from pathlib import Path
import joynexus.cli, joynexus.api.cli, uvicorn
from joynexus.api.app import ApiSettings, create_app
from joynexus.connect import Cluster
from joynexus.settings import Settings
imported = sorted(m for m in sys.modules if m.split(".")[0] in HEAVY)
settings = Settings(data_dir=Path(sys.argv[1]))
cluster = Cluster(settings=settings, master=object(), training=object(), inference=object(),
                  environment=object(), queue=object(), mode="ray")
app = create_app(cluster, ApiSettings(), admin_key="jnx-test-admin-key-0123456789")
assert cluster.checkpoints is not None and app.state.role_follower is not None
built = sorted(m for m in sys.modules if m.split(".")[0] in HEAVY)
cluster.close()
print(json.dumps({"imported": imported, "built": built}))
"""


def test_serve_imports_and_builds_its_app_without_torch_or_transformers(tmp_path):
    code = SERVE.replace("HEAVY", repr(set(HEAVY)))
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"imported": [], "built": []}


def test_errors_keep_their_old_import_paths_and_identity():
    """Code that imported the exceptions from the service modules still catches the same classes."""
    from joynexus.master import errors as master_errors
    from joynexus.master.options import MasterOptions
    from joynexus.master.service import MasterOptions as ServiceMasterOptions
    from joynexus.master.service import TenantUnavailable
    from joynexus.master.workloads.manager import AdmissionRefused, UnknownWorkload
    from joynexus.services.training import errors as training_errors
    from joynexus.services.training.service import TenantSlotError
    from joynexus.services.training.slots import UnknownTenant

    assert TenantUnavailable is master_errors.TenantUnavailable
    assert AdmissionRefused is master_errors.AdmissionRefused and UnknownWorkload is master_errors.UnknownWorkload
    assert ServiceMasterOptions is MasterOptions
    assert TenantSlotError is training_errors.TenantSlotError and UnknownTenant is training_errors.UnknownTenant
