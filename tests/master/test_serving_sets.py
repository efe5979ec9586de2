"""The serving set survives every restart path (issue 26.7): a tenant that serves an older version
(loaded explicitly while training moved on) is served exactly that after the Inference Model
Service restarts, and after the whole deployment (Master and services) comes up again on the same
store; a deleted tenant's set is forgotten."""

from __future__ import annotations

from joynexus.artifacts import encode_tenant_payload
from joynexus.connect import in_process
from joynexus.core.serving_sets import ServingSetStore
from joynexus.master.service import MasterService
from joynexus.scheduling.inference_queue import Observation
from joynexus.services.configs import InferenceServiceConfig
from joynexus.settings import Settings
from tests.helpers import random_microbatch, sft_spec, write_dataset_for


def _predicted_version(cluster, tenant_id: str, config) -> int:
    batch = random_microbatch(config, 1, seed=0)
    obs = [Observation(images=tuple(batch["images"][0]), state=batch["state"][0], instruction="pick up the cube")]
    return cluster.inference.predict(tenant_id, obs, timeout_s=60)["policy_version"]


def test_a_pinned_older_version_is_served_again_after_every_restart(tmp_path):
    settings = Settings(data_dir=tmp_path / "data", torch_threads=1)
    spec = sft_spec("pin", tmp_path / "pin", jobs=None, samples_per_job=8, microbatch_size=8)
    write_dataset_for(spec, episodes=2, length=8)
    cluster = in_process(settings)
    try:
        config = cluster.master.create_tenant(spec).backend_config
        cluster.training.save(["pin"], True)  # checkpoint v0, then serve it explicitly
        manifest, state, _ = cluster.checkpoints.load_tenant("pin", 0)
        cluster.inference.load_weights(encode_tenant_payload(state, manifest))
        cluster.training.train_batch("pin", random_microbatch(config, 4, seed=1))  # training moves to v1
        cluster.training.save(["pin"], True)
        assert cluster.training.policy_version("pin") == 1
        assert ServingSetStore(cluster.master.deployment.store).get("pin").versions == (0,)

        # The Inference Model Service restarts (a new one, empty): the Master's restore on its new
        # incarnation serves v0 again, not the training slot's v1.
        deployment = cluster.master.deployment
        fresh = _restart_inference(deployment, settings)
        cluster.inference = fresh
        cluster.master._restore_role("inference_service", {"tenants": ["pin"]}, {})
        assert fresh.versions("pin") == [0]
        assert _predicted_version(cluster, "pin", config) == 0

        # The Master and the Inference Model Service both start again on the same store (a Master
        # restart, or down + up): the new Master serves v0 again before it takes work.
        cluster.master.shutdown()
        cluster.inference = _restart_inference(deployment, settings)
        cluster.master = MasterService(deployment=deployment)
        assert cluster.inference.versions("pin") == [0]
        assert _predicted_version(cluster, "pin", config) == 0
        cluster.master.delete_tenant("pin")
        assert ServingSetStore(deployment.store).get("pin") is None
    finally:
        cluster.close()


def test_a_version_published_before_any_checkpoint_is_served_again_after_training_moved_on(tmp_path):
    """`publish_weights` of a version that has no checkpoint (v0 at creation, or a lower-layer step)
    checkpoints it first: after the slot trained past it (no checkpoint of its own) and the
    Inference Model Service restarted, the Master serves it again (the Ray replica test's front
    restart found it lost: "no policy version 0 (served: [], checkpoints: [])")."""
    settings = Settings(data_dir=tmp_path / "data", torch_threads=1)
    spec = sft_spec("early", tmp_path / "early", jobs=None, samples_per_job=8, microbatch_size=8)
    write_dataset_for(spec, episodes=2, length=8)
    cluster = in_process(settings)
    try:
        config = cluster.master.create_tenant(spec).backend_config
        assert cluster.checkpoints.versions("early") == []
        assert cluster.master.publish_weights("early") == 0
        assert cluster.checkpoints.versions("early") == [0]  # what is served can be served again
        cluster.training.train_batch("early", random_microbatch(config, 4, seed=1))  # v1, no checkpoint
        assert cluster.master.publish_weights("early") == 1
        cluster.training.train_batch("early", random_microbatch(config, 4, seed=2))  # the slot moves on to v2
        assert cluster.checkpoints.versions("early") == [0, 1]
        deployment = cluster.master.deployment
        cluster.inference = fresh = _restart_inference(deployment, settings)
        cluster.master._restore_role("inference_service", {"tenants": ["early"]}, {})
        assert fresh.versions("early") == [0, 1]
        assert _predicted_version(cluster, "early", config) == 1
    finally:
        cluster.close()


def _restart_inference(deployment, settings):
    """A new, empty Inference Model Service in place of the deployment's (what a restart leaves)."""
    deployment.inference_service.close()
    deployment.inference_service = InferenceServiceConfig.from_settings(settings).build()
    return deployment.inference_service
