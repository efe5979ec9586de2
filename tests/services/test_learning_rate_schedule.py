"""training.lr_decay_jobs / lr_final_fraction: a linear learning-rate decay over a tenant's first
jobs (its policy versions), set on the tenant's AdamW before each job; validated by name."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from joynexus.services.training.slots import TenantSlot
from joynexus.spec import SpecError, parse_workload_spec
from tests.helpers import sft_spec


def _slot(version: int, **schedule: object) -> SimpleNamespace:
    config = SimpleNamespace(learning_rate=1e-3, lr_decay_jobs=None, lr_final_fraction=0.1)
    config.__dict__.update(schedule)
    optimizer = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters(), lr=config.learning_rate)
    return SimpleNamespace(config=config, version=version, optimizer=optimizer)


def scheduled_learning_rate(slot: SimpleNamespace) -> float:
    """`TenantSlot.schedule_learning_rate` on a stand-in with the fields it reads."""
    return TenantSlot.schedule_learning_rate(slot)  # type: ignore[arg-type]


def test_the_rate_falls_linearly_over_the_decay_jobs_then_stays_at_the_final_fraction():
    rates = []
    for version in range(7):
        slot = _slot(version, lr_decay_jobs=4, lr_final_fraction=0.25)
        rates.append(scheduled_learning_rate(slot))
        assert all(group["lr"] == rates[-1] for group in slot.optimizer.param_groups)  # what the job steps with
    assert rates == pytest.approx([1e-3, 8.125e-4, 6.25e-4, 4.375e-4, 2.5e-4, 2.5e-4, 2.5e-4])
    # Without a schedule the configured rate, whatever the version (a forked tenant's included).
    assert scheduled_learning_rate(_slot(50)) == 1e-3


def test_the_schedule_is_compiled_into_the_tenant_and_bad_values_are_named():
    from joynexus.core.tenants import BackendCapabilities, BaseModelCapabilities
    from joynexus.master.tenant_creator import SpecCompiler
    from joynexus.models.backbone import ResidentBackbone

    spec = sft_spec("decaying", "/unused")
    spec.update(task="eval", dataset=None)
    spec["training"] = {"lr_decay_jobs": 40, "lr_final_fraction": 0.05}
    caps = BaseModelCapabilities.of_backbone(ResidentBackbone.build_tiny())
    config = SpecCompiler(BackendCapabilities.single(caps)).compile(parse_workload_spec(spec))
    assert (config.lr_decay_jobs, config.lr_final_fraction) == (40, 0.05)
    for field, value in (("lr_final_fraction", 1.5), ("lr_decay_jobs", 0)):
        spec["training"] = {field: value}
        with pytest.raises(SpecError) as refused:
            parse_workload_spec(spec)
        assert f"training.{field}" in str(refused.value)
