"""Fixtures shared by the Training Model Service tests: two tenants' datasets with different
schemas, and an in-process deployment around one Training Model Service."""

from __future__ import annotations

import pytest

from joynexus.core.store import ControlPlaneStore
from joynexus.core.tenants import BackendCapabilities
from joynexus.master.tenant_creator import TenantCreator
from joynexus.models.backbone import BackboneSource
from joynexus.scheduling.training_queue import TrainingQueue
from joynexus.scheduling.training_scheduler import TrainingScheduler
from joynexus.services.training.service import TrainingModelService
from tests.helpers import sft_spec, write_dataset_for

# Two schemas: different camera sets, image sizes, state/action dims, chunk lengths and module kinds.
TENANT_SHAPES = {
    "alpha": dict(cameras=("front", "wrist"), image_size=(32, 32), state_dim=4, action_dim=3, action_chunk=2),
    "beta": dict(
        cameras=("top",), image_size=(24, 40), state_dim=6, action_dim=5, action_chunk=4, module="flow_matching"
    ),
}


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    """Workload specs of `TENANT_SHAPES`, each with a LeRobot dataset written for it."""
    root = tmp_path_factory.mktemp("datasets")
    specs = {}
    for i, (name, shape) in enumerate(TENANT_SHAPES.items()):
        spec = sft_spec(name, root / name, jobs=6, **shape)
        write_dataset_for(spec, seed=i)
        specs[name] = spec
    return specs


@pytest.fixture
def world(tmp_path, datasets):
    """A local (in-process) deployment: store, scheduler, queue, tenant creator, one Training Model
    Service with a slot for each of `datasets`' tenants."""
    queue = TrainingQueue()
    service = TrainingModelService(BackboneSource(preset="tiny"), tmp_path / "ckpt", queue=queue, num_threads=1)
    store = ControlPlaneStore(f"sqlite:///{tmp_path / 'control.db'}")
    scheduler = TrainingScheduler(store, release_partition=queue.clear)
    creator = TenantCreator(store, scheduler, BackendCapabilities.single(service.capabilities()))
    tenants = {}
    for name, spec in datasets.items():
        spec = {**spec, "base_model": service.backbone.model_id}
        tenants[name] = creator.create(spec)
        service.add_tenant(tenants[name].backend_config)
    yield {
        "queue": queue,
        "service": service,
        "scheduler": scheduler,
        "creator": creator,
        "tenants": tenants,
        "tmp": tmp_path,
    }
    store.dispose()
