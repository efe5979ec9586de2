"""`services.call_futures.CallFutures` over a real Training Model Service (tiny backbone): a step
applies all of its chain's microbatches or none, abandoned chains' gradients are discarded, kept
results are bounded in time and count, a tenant's waiting calls are bounded."""

from __future__ import annotations

import time

import pytest
import torch

from joynexus.models.backbone import BackboneSource
from joynexus.services.call_futures import CallFutures, FutureLimits, FutureRefused, UnknownFuture
from joynexus.services.training.service import TenantSlotError, TrainingModelService
from tests.api.test_training_primitives import add, columns, params


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    return TrainingModelService(BackboneSource(preset="tiny"), tmp_path_factory.mktemp("ckpt"), num_threads=1)


def futures(service, **limits) -> CallFutures:
    return CallFutures(service, None, limits=FutureLimits(**limits), sweep=False)


def result(queue: CallFutures, tenant_id: str, future_id: str) -> dict:
    info = queue.collect(tenant_id, future_id, wait_s=30)
    assert info["state"] in ("done", "failed"), info
    return info


def test_a_failed_microbatch_voids_its_step_and_the_chain_starts_afresh(service):
    cfg = add(service, "cf-fail", "arm")
    queue = futures(service)
    before = params(service, cfg.tenant_id)
    good = queue.submit(cfg.tenant_id, "forward_backward", {"batch": columns(cfg, "arm", seed=1)})
    bad_batch = {**columns(cfg, "arm", seed=2), "tenant_id": ["someone-else"] * 4}
    bad = queue.submit(cfg.tenant_id, "forward_backward", {"batch": bad_batch})
    step = queue.submit(cfg.tenant_id, "optim_step", {})
    assert result(queue, cfg.tenant_id, good["future_id"])["state"] == "done"
    assert isinstance(result(queue, cfg.tenant_id, bad["future_id"])["error"], TenantSlotError)
    refused = result(queue, cfg.tenant_id, step["future_id"])["error"]
    assert isinstance(refused, TenantSlotError) and bad["future_id"] in str(refused)
    # Nothing was applied, and the good microbatch's gradients are gone with the step.
    assert service.policy_version(cfg.tenant_id) == 0
    assert all(torch.equal(v, params(service, cfg.tenant_id)[k]) for k, v in before.items())
    assert service.discard_pending_gradients(cfg.tenant_id)["microbatches"] == 0
    again = queue.submit(cfg.tenant_id, "forward_backward", {"batch": columns(cfg, "arm", seed=3)})
    assert result(queue, cfg.tenant_id, again["future_id"])["result"]["accumulated_microbatches"] == 1
    done = result(queue, cfg.tenant_id, queue.submit(cfg.tenant_id, "optim_step", {})["future_id"])
    assert done["result"]["microbatches"] == 1 and done["result"]["version"] == 1
    queue.close()


def test_an_abandoned_chain_s_gradients_are_discarded_after_the_timeout(service):
    cfg, other = add(service, "cf-lost", "arm"), add(service, "cf-kept", "arm")
    queue = futures(service, abandon_after_s=30.0)
    for tenant in (cfg, other):
        fb = queue.submit(tenant.tenant_id, "forward_backward", {"batch": columns(tenant, "arm")})
        result(queue, tenant.tenant_id, fb["future_id"])
    assert queue.sweep() == []  # within the timeout: kept
    assert queue.tenant_status(cfg.tenant_id)["open_gradients"]
    # Past the timeout with no call or collect: the sweep discards them (the other tenant's client
    # was just in touch, so its chain stays).
    queue._tenants[cfg.tenant_id].last_contact -= 31.0
    assert queue.sweep() == [cfg.tenant_id]
    status = queue.tenant_status(cfg.tenant_id)
    assert not status["open_gradients"] and "1 forward_backward microbatches were discarded" in status["discarded"]
    assert service.discard_pending_gradients(cfg.tenant_id)["microbatches"] == 0  # really gone
    step = result(queue, cfg.tenant_id, queue.submit(cfg.tenant_id, "optim_step", {})["future_id"])
    assert "no pending gradients to apply" in str(step["error"]) and service.policy_version(cfg.tenant_id) == 0
    kept = result(queue, other.tenant_id, queue.submit(other.tenant_id, "optim_step", {})["future_id"])
    assert kept["result"]["microbatches"] == 1
    queue.close()


def test_the_next_call_discards_an_abandoned_chain_before_it_runs(service):
    cfg = add(service, "cf-next", "arm")
    queue = futures(service, abandon_after_s=30.0)
    first = queue.submit(cfg.tenant_id, "forward_backward", {"batch": columns(cfg, "arm")})
    result(queue, cfg.tenant_id, first["future_id"])
    queue._tenants[cfg.tenant_id].last_contact -= 31.0
    fresh = queue.submit(cfg.tenant_id, "forward_backward", {"batch": columns(cfg, "arm", seed=4)})
    assert result(queue, cfg.tenant_id, fresh["future_id"])["result"]["accumulated_microbatches"] == 1
    queue.close()


def test_kept_results_and_waiting_calls_are_bounded(service):
    cfg = add(service, "cf-bounds", "arm")
    queue = futures(service, max_kept_per_tenant=2, keep_results_s=60.0, max_pending_per_tenant=3)
    ids = [queue.submit(cfg.tenant_id, "forward_backward", {"batch": columns(cfg, "arm", seed=s)})["future_id"]
           for s in range(3)]  # fmt: skip
    with pytest.raises(FutureRefused, match="limit is 3"):
        queue.submit(cfg.tenant_id, "optim_step", {})
    result(queue, cfg.tenant_id, ids[2])  # the last ran, so all three did
    with pytest.raises(UnknownFuture):  # the oldest of three finished results went
        queue.collect(cfg.tenant_id, ids[0])
    assert queue.collect(cfg.tenant_id, ids[1])["state"] == "done"
    queue.sweep(now=time.time() + 61.0)  # past keep_results_s: all go
    with pytest.raises(UnknownFuture):
        queue.collect(cfg.tenant_id, ids[2])
    with pytest.raises(UnknownFuture):  # and nobody else reads them
        queue.collect("someone-else", ids[1])
    queue.close()


def test_the_sweep_keeps_gradients_the_chain_did_not_leave(service):
    cfg = add(service, "cf-mixed", "arm")
    queue = futures(service, abandon_after_s=30.0)
    first = queue.submit(cfg.tenant_id, "forward_backward", {"batch": columns(cfg, "arm")})
    result(queue, cfg.tenant_id, first["future_id"])
    # The client went on with blocking calls: a step, then a fresh microbatch of its own.
    service.optim_step(cfg.tenant_id)
    service.forward_backward(cfg.tenant_id, columns(cfg, "arm", seed=5))
    queue._tenants[cfg.tenant_id].last_contact -= 31.0
    queue.sweep()
    assert queue.tenant_status(cfg.tenant_id)["discarded"] is None
    assert service.optim_step(cfg.tenant_id)["microbatches"] == 1  # its microbatch was kept
    queue.sweep(now=time.time() + 700.0)  # results expired, nothing open: the tenant's entry goes
    assert cfg.tenant_id not in queue._tenants
    queue.close()
