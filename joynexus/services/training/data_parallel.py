"""A data-parallel training group (issue 45.2, the paper's 2-GPU Training Model Service, 5.1): one
logical Training Model Service over K ranks, each rank a process with its own backbone replica and
a replica of every tenant's slot (same seeds, so the same initial weights).

A grouped step (`DataParallelGroup.train_group`) splits every tenant's microbatch by rows across
the ranks (contiguous chunks, sizes differing by at most one); each rank runs its own backbone
forward and its tenants' losses on its chunk, then, where every update path clips
(`trainer.clip_gradients`), each tenant's gradients are all-reduced (`torch.distributed`, one flat
buffer per tenant; gloo on CPUs, NCCL on GPUs) weighted by the chunk's share of the rows, which
makes them the gradients of the whole microbatch's mean loss. Every rank then clips and steps the
same AdamW on the same gradients: tenant state stays identical on every rank, which the group
checks after each step (`state_digest`), and equals the single-device step within float tolerance.

Limits (the caller's to respect): a tenant's microbatch needs at least K rows. Equality with the
single-device step holds for losses that are deterministic per-sample means (oft_mlp); a loss that
draws randomness per microbatch (flow matching's noise and times) draws it per rank for the rank's
chunk, so its step is an equally valid estimate but not the single device's draw for draw (its
ranks still stay identical). Padded chunk steps weigh slightly differently than in one forward. A
non-finite loss on one rank only would leave the others waiting in the all-reduce.
"""

from __future__ import annotations

import hashlib
import os
import socket
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from joynexus.services.training.gradient_sync import WeightedAllReduce, install_gradient_reducer

__all__ = ["DataParallelGroup", "DataParallelRank", "RankStateDiverged", "split_rows"]


def split_rows(rows: int, ranks: int) -> list[slice]:
    """Contiguous chunks of `rows` for `ranks`, sizes differing by at most one (first ranks larger)."""
    if rows < ranks:
        raise ValueError(f"a microbatch of {rows} rows cannot be split across {ranks} ranks (needs >= {ranks})")
    base, extra = divmod(rows, ranks)
    bounds = np.cumsum([0] + [base + (1 if r < extra else 0) for r in range(ranks)])
    return [slice(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def _chunk(batch: dict[str, Any], rows: slice) -> dict[str, Any]:
    return {k: (v[rows] if isinstance(v, np.ndarray | list | torch.Tensor) else v) for k, v in batch.items()}


class DataParallelRank:
    """One rank: a `TrainingModelService` replica in its own process, joined to the group's
    process group. Built by `DataParallelGroup` (Ray actors) or directly in a spawned process."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        init_method: str,
        backbone_source: Any,
        checkpoint_root: str,
        *,
        backend: str = "gloo",
        num_threads: int = 1,
        placement: Any = None,
    ) -> None:
        """`placement`: the rank's device placement (`TrainingModelService`'s); None: what the rank's
        environment says (JOYNEXUS_DEVICE, _DTYPE, _AUTOCAST), e.g. the GPU Ray gave it."""
        import torch.distributed as dist

        from joynexus.services.training.service import TrainingModelService

        self.rank, self.world_size = rank, world_size
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
        # Every rank has its own checkpoint folder: only rank 0's versions are the group's.
        root = checkpoint_root if rank == 0 else os.path.join(checkpoint_root, f".rank-{rank}")
        self.service = TrainingModelService(backbone_source, root, num_threads=num_threads, placement=placement)
        self.reducer = WeightedAllReduce()
        install_gradient_reducer(self.reducer)

    def add_tenant(self, config: Any, resume: bool = True) -> dict[str, Any]:
        return self.service.add_tenant(config, resume=resume)

    def train_group(self, batches: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
        """This rank's chunk of every tenant's microbatch through the service's grouped step; the
        tenants' gradients are all-reduced inside it; the loss reported is the whole microbatch's."""
        import torch.distributed as dist

        chunks, weights = [], {}
        for tenant_id, batch in batches:
            rows = len(batch["task"])
            mine = split_rows(rows, self.world_size)[self.rank]
            chunks.append((tenant_id, _chunk(batch, mine)))
            weights[tenant_id] = (mine.stop - mine.start) / rows
        self.reducer.weights = weights
        try:
            results = self.service.train_group(chunks)
        finally:
            self.reducer.weights = {}
        # The whole microbatch's loss: the chunks' losses weighted by their rows, summed.
        losses = torch.tensor([(r.get("loss") or 0.0) * weights[r["tenant_id"]] for r in results], dtype=torch.float64)
        dist.all_reduce(losses, op=dist.ReduceOp.SUM)
        for result, loss in zip(results, losses.tolist(), strict=True):
            if result.get("loss") is not None:
                result["loss"] = loss
                slot = self.service.slot_table.slot(result["tenant_id"])
                slot.losses[-1] = loss  # the history every rank keeps is the group's, not the chunk's
        return results

    def state_digest(self, tenant_id: str) -> str:
        """SHA-256 of the tenant's version, parameters and optimizer state (equal on every rank)."""
        state = self.service.tenant_state(tenant_id)
        digest = hashlib.sha256(str(state["version"]).encode())
        for name, tensor in sorted(state["module"].items()):
            digest.update(name.encode())
            digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
        for index, values in sorted(state["optimizer"]["state"].items()):
            for key, value in sorted(values.items()):
                digest.update(f"{index}/{key}".encode())
                if isinstance(value, torch.Tensor):
                    digest.update(value.detach().cpu().contiguous().numpy().tobytes())
                else:
                    digest.update(repr(value).encode())
        return digest.hexdigest()

    def tenant_state(self, tenant_id: str) -> dict[str, Any]:
        return self.service.tenant_state(tenant_id)

    def close(self) -> None:
        import torch.distributed as dist

        install_gradient_reducer(None)
        if dist.is_initialized():
            dist.destroy_process_group()


class RankStateDiverged(RuntimeError):
    """Tenant state differs between ranks after a step (it must never: every rank steps the same)."""


class DataParallelGroup:
    """One logical Training Model Service over K ranks (Ray actors, one device each when the
    training role asks for GPUs): tenants are added on every rank, grouped steps run on all of
    them at once, and each step ends with a check that every rank holds the same tenant state."""

    def __init__(self, ranks: Sequence[Any]) -> None:
        from joynexus.actors import service_handle

        self.ranks = [service_handle(DataParallelRank, r) for r in ranks]

    @classmethod
    def start(
        cls,
        world_size: int,
        backbone_source: Any,
        checkpoint_root: str,
        *,
        backend: str = "gloo",
        num_cpus: float = 1,
        num_gpus: float = 0,
        placement: Any = None,
    ) -> DataParallelGroup:
        """K rank actors on this Ray cluster (initialized), rendezvous over TCP at this node."""
        import ray

        from joynexus.actors import actor_class

        address = ray.util.get_node_ip_address()
        init_method = f"tcp://{address}:{_free_port()}"
        remote = ray.remote(actor_class(DataParallelRank)).options(num_cpus=num_cpus, num_gpus=num_gpus)
        ranks = [
            remote.remote(
                r, world_size, init_method, backbone_source, checkpoint_root, backend=backend, placement=placement
            )
            for r in range(world_size)
        ]
        return cls(ranks)

    def _all(self, method: Callable[..., Any], *args: Any) -> list[Any]:
        from joynexus.actors import handle_of

        futures = [handle_of(r).start(method, *args) for r in self.ranks]
        return [f.result() for f in futures]

    def add_tenant(self, config: Any, resume: bool = True) -> dict[str, Any]:
        return self._all(DataParallelRank.add_tenant, config, resume)[0]

    def train_group(self, batches: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
        results = self._all(DataParallelRank.train_group, batches)
        for tenant_id, _ in batches:
            digests = set(self._all(DataParallelRank.state_digest, tenant_id))
            if len(digests) != 1:
                raise RankStateDiverged(f"tenant {tenant_id!r}: {len(digests)} different states over the ranks")
        return results[0]

    def tenant_state(self, tenant_id: str) -> dict[str, Any]:
        return self.ranks[0].tenant_state(tenant_id)

    def state_digests(self, tenant_id: str) -> list[str]:
        return self._all(DataParallelRank.state_digest, tenant_id)

    def close(self) -> None:
        self._all(DataParallelRank.close)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]
