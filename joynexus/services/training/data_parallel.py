"""A data-parallel training group (issue 45.2, the paper's 2-GPU Training Model Service, 5.1): one
logical Training Model Service over K ranks, each rank a Ray actor with its own backbone replica on
its own device bundle and a replica of every tenant's slot (same seeds, so the same initial weights).

`DataParallelTrainingService` is that logical service: it has `TrainingModelService`'s public
methods, so a deployment runs it as the training role (`JOYNEXUS_TRAINING_DATA_PARALLEL` = K, the
actor `joynexus.training_service` or each shard; `services.configs.TrainingServiceConfig`) and the
Master, the Training Scheduler's actor loop and the shard set call it as they call one device.
Calls that change tenant state run on every rank; reads are answered by rank 0.

How a step is split. SFT microbatches (a leased SFT job's, `train_job` / `train_jobs`, and supplied
ones, `train_group` / `train_batch`) are split by rows across the ranks (contiguous chunks, sizes
differing by at most one; a job's ranks each read the partition on their own cursor and keep their
chunk, `RankQueue`, so no rank and no driver ships another's data). Each rank runs its own backbone
forward and its tenants' losses on its chunk, then, where every update path clips
(`trainer.clip_gradients`), each tenant's gradients are all-reduced (`torch.distributed`, one flat
buffer per tenant; gloo on CPUs, NCCL on GPUs) weighted by the chunk's share of the rows, which makes
them the gradients of the whole microbatch's mean loss; the reported losses are the whole
microbatch's. Every rank then clips and steps the same AdamW on the same gradients: tenant state stays
identical on every rank, which the service checks after training calls (`state_digest`), and equals
the single-device step within float tolerance. Steps whose rows are not split (an RL job's PPO run,
the lower-layer `forward_backward` / `optim_step`, a microbatch of fewer than K rows) run on every
rank on the same rows with their gradients averaged over the ranks: equal to one device, and the
ranks cannot drift apart by floating-point nondeterminism.

Limits: equality with the single-device step holds for losses that are deterministic per-sample means
(oft_mlp); a loss that draws randomness per microbatch (flow matching's noise and times) draws it per
rank for the rank's chunk, so its step is an equally valid estimate but not the single device's draw
for draw (its ranks still stay identical). A non-finite loss on one rank only leaves the others in the
all-reduce until the group's collective timeout, after which the call fails. A rank that dies takes
the logical service with it: the service's process exits, Ray restarts it in place with new ranks, and
the Master's Health Manager restores the tenants (a new incarnation), as for a one-device service.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from joynexus.artifacts import CheckpointStore, TenantManifest
from joynexus.services.training.gradient_sync import WeightedAllReduce, install_gradient_reducer

__all__ = [
    "DataParallelRank",
    "DataParallelTrainingService",
    "RankQueue",
    "RankStateDiverged",
    "split_rows",
]

DEFAULT_COLLECTIVE_TIMEOUT_S = 600.0  # like the default role bound: a longer wait is a hang


def split_rows(rows: int, ranks: int) -> list[slice]:
    """Contiguous chunks of `rows` for `ranks`, sizes differing by at most one (first ranks larger)."""
    if rows < ranks:
        raise ValueError(f"a microbatch of {rows} rows cannot be split across {ranks} ranks (needs >= {ranks})")
    base, extra = divmod(rows, ranks)
    bounds = np.cumsum([0] + [base + (1 if r < extra else 0) for r in range(ranks)])
    return [slice(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def _chunk(batch: dict[str, Any], rows: slice) -> dict[str, Any]:
    return {k: (v[rows] if isinstance(v, np.ndarray | list | torch.Tensor) else v) for k, v in batch.items()}


class RankQueue:
    """A rank's view of the Training Queue: every rank reads a job's partition on its own cursor (the
    task name plus `/rank-<r>`), and of an SFT partition's microbatches (`split`) keeps only its chunk
    of rows, setting the tenant's gradient weight to the chunk's share; every other read is the whole
    microbatch (the reducer then averages identical gradients). Anything else goes to the queue."""

    def __init__(self, queue: Any, rank: int, world_size: int, reducer: WeightedAllReduce) -> None:
        self.queue, self.rank, self.world_size, self.reducer = queue, rank, world_size, reducer
        self.split: dict[str, str] = {}  # SFT partition id -> its tenant, for the call in progress
        self.shares: dict[str, list[float]] = {}  # partition -> this rank's share of each microbatch read
        self.rows_not_seen: dict[str, int] = {}  # tenant -> rows of its microbatches other ranks stepped

    def begin(self, sft_jobs: Sequence[Any]) -> None:
        self.split = {job.partition_id: job.tenant_id for job in sft_jobs}
        self.shares = {pid: [] for pid in self.split}
        self.rows_not_seen = {}

    def get_meta(self, partition_id: str, fields: Any, batch_size: int, task_name: str = "train", order: Any = None):
        return self.queue.get_meta(partition_id, fields, batch_size, f"{task_name}/rank-{self.rank}", order)

    def get_data(self, meta: Any) -> dict[str, Any]:
        data = self.queue.get_data(meta)
        tenant = self.split.get(meta.partition_id)
        if tenant is None:
            return data
        rows = int(meta.size)
        if rows < self.world_size:  # too few rows to split: every rank steps them all
            self.reducer.weights[tenant] = 1.0 / self.world_size
            self.shares[meta.partition_id].append(1.0 / self.world_size)
            return data
        mine = split_rows(rows, self.world_size)[self.rank]
        share = (mine.stop - mine.start) / rows
        self.reducer.weights[tenant] = share
        self.shares[meta.partition_id].append(share)
        self.rows_not_seen[tenant] = self.rows_not_seen.get(tenant, 0) + rows - (mine.stop - mine.start)
        return _chunk(data, mine)

    def end(self) -> None:
        for tenant in self.split.values():
            self.reducer.weights.pop(tenant, None)
        self.split = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.queue, name)


class RankCheckpoints(CheckpointStore):
    """The group's checkpoint folder as a rank other than 0 sees it: it reads what rank 0 wrote
    (every rank resumes and rolls back from the same versions, also a tenant's checkpoints written
    before it came to this group) and writes nothing: rank 0 writes each version once, in the same
    call every rank runs, so the folder never holds K copies nor races K writers. `SlotTable.save`
    builds nothing for a store that does not write (`writes`)."""

    writes = False

    def save_tenant(self, **fields: Any) -> TenantManifest:
        raise RuntimeError(f"tenant {fields.get('tenant_id')!r}: a data-parallel rank > 0 writes no checkpoint")

    def record_issued_version(self, tenant_id: str, version: int) -> None:
        return None  # rank 0 records it, in the same training call


class DataParallelRank:
    """One rank: a `TrainingModelService` replica in its own process (a Ray actor), joined to the
    group's process group by `join` (rank 0 first names the rendezvous, `rendezvous`)."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        backbone_source: Any,
        checkpoint_root: str,
        queue: Any = None,
        num_threads: int | None = 1,
        **service_options: Any,
    ) -> None:
        """`service_options`: `TrainingModelService`'s keyword arguments (placement None: what the
        rank's environment says, e.g. the GPU Ray gave it)."""
        from joynexus.actors import service_handle
        from joynexus.scheduling.training_queue import TrainingQueue
        from joynexus.services.training.service import TrainingModelService

        self.rank, self.world_size = rank, world_size
        self.reducer = WeightedAllReduce(default_weight=1.0 / world_size)
        self.queue = (
            RankQueue(service_handle(TrainingQueue, queue), rank, world_size, self.reducer)
            if queue is not None
            else None
        )
        # One checkpoint folder for the group: rank 0 writes it, every rank reads it (`RankCheckpoints`).
        store_type = CheckpointStore if rank == 0 else RankCheckpoints
        store = store_type(checkpoint_root, keep_last=service_options.pop("keep_last", None))
        self.service = TrainingModelService(backbone_source, store, self.queue, num_threads, **service_options)
        self.backend = "nccl" if self.service.device.type == "cuda" else "gloo"

    def rendezvous(self) -> str:
        """A TCP address on this rank's node for the group's rendezvous (rank 0 listens there)."""
        import ray

        return f"tcp://{ray.util.get_node_ip_address()}:{_free_port()}"

    def join(self, init_method: str, timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S) -> str:
        import torch.distributed as dist

        dist.init_process_group(
            self.backend,
            init_method=init_method,
            rank=self.rank,
            world_size=self.world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        install_gradient_reducer(self.reducer)
        return self.backend

    def heartbeat(self) -> dict[str, Any]:
        return {"rank": self.rank, **self.service.heartbeat()}

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """One of the service's methods on this rank (every rank runs the same call)."""
        return getattr(self.service, method)(*args, **kwargs)

    # -- training: rows split across ranks -----------------------------------------------------
    def train_group(self, batches: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
        """This rank's chunk of every tenant's microbatch through the service's grouped step; the
        tenants' gradients are all-reduced inside it; the loss reported is the whole microbatch's."""
        chunks, weights = self._split(batches)
        self.reducer.weights = weights
        try:
            results = self.service.train_group(chunks)
        finally:
            self.reducer.weights = {}
        self._group_losses([(r["tenant_id"], [r.get("loss")], [weights[r["tenant_id"]]]) for r in results], results)
        return results

    def train_batch(self, tenant_id: str, batch: dict[str, Any]) -> dict[str, Any]:
        chunks, weights = self._split([(tenant_id, batch)])
        self.reducer.weights = weights
        try:
            result = self.service.train_batch(tenant_id, chunks[0][1])
        finally:
            self.reducer.weights = {}
        self._group_losses([(tenant_id, [result.get("loss")], [weights[tenant_id]])], [result])
        self._count_rows({tenant_id: len(batch["task"]) - len(chunks[0][1]["task"])})
        return result

    def train_job(self, job: Any) -> dict[str, Any]:
        return self.train_jobs([job], serial=True)[0]

    def train_jobs(self, jobs: list[Any], serial: bool = False) -> list[dict[str, Any]]:
        """Leased jobs, each rank reading every partition itself (`RankQueue`): an SFT job's
        microbatches split by rows, an RL job's PPO run on every rank whole."""
        from joynexus.scheduling.training_scheduler import TrainingJob

        if self.queue is None:  # the service refuses it with its own message
            return [self.service.train_job(jobs[0])] if serial else self.service.train_jobs(jobs)
        parsed = [j if isinstance(j, TrainingJob) else TrainingJob(**j) for j in jobs]
        self.queue.begin([j for j in parsed if j.task_type != "rl"])
        try:
            results = [self.service.train_job(parsed[0])] if serial else self.service.train_jobs(parsed)
            shares, not_seen = dict(self.queue.shares), dict(self.queue.rows_not_seen)
        finally:
            self.queue.end()
        split, split_results = [], []
        for job, result in zip(parsed, results, strict=True):
            if job.partition_id in shares and "error" not in result:
                split.append((job.tenant_id, list(result.get("losses") or []), shares[job.partition_id]))
                split_results.append(result)
        self._group_losses(split, None)
        for (_, losses, _), result in zip(split, split_results, strict=True):
            result["losses"] = losses
        self._count_rows(not_seen)
        return results

    def _split(
        self, batches: list[tuple[str, dict[str, Any]]]
    ) -> tuple[list[tuple[str, dict[str, Any]]], dict[str, float]]:
        chunks, weights = [], {}
        for tenant_id, batch in batches:
            rows = len(batch["task"])
            mine = split_rows(rows, self.world_size)[self.rank]
            chunks.append((tenant_id, _chunk(batch, mine)))
            weights[tenant_id] = (mine.stop - mine.start) / rows
        return chunks, weights

    def _group_losses(
        self, split: list[tuple[str, list[Any], list[float]]], results: list[dict[str, Any]] | None
    ) -> None:
        """Each split step's loss made the whole microbatch's (the ranks' chunk losses weighted by
        their shares, summed over the group), in the results and in the tenant's loss history."""
        import torch.distributed as dist

        flat = [
            (loss or 0.0) * share for _, losses, shares in split for loss, share in zip(losses, shares, strict=True)
        ]
        if not flat:
            return
        device = self.service.device if self.backend == "nccl" else torch.device("cpu")
        summed = torch.tensor(flat, dtype=torch.float64, device=device)
        dist.all_reduce(summed, op=dist.ReduceOp.SUM)
        values = iter(summed.tolist())
        for index, (tenant_id, losses, _) in enumerate(split):
            group = [next(values) for _ in losses]
            if any(loss is None for loss in losses):  # a step that failed: nothing to report or record
                continue
            losses[:] = group
            if results is not None:
                results[index]["loss"] = group[0]
            history = self.service.slot_table.slot(tenant_id).losses
            if group and len(history) >= len(group):
                history[-len(group) :] = group  # every rank keeps the group's history, not its chunk's

    def _count_rows(self, rows_not_seen: dict[str, int]) -> None:
        """The samples other ranks stepped, counted here too: every rank's counters are the group's."""
        for tenant_id, rows in rows_not_seen.items():
            if rows:
                self.service.slot_table.slot(tenant_id).samples_trained += rows

    def state_digest(self, tenant_id: str) -> str:
        """SHA-256 of the tenant's version, parameters and optimizer state (equal on every rank)."""
        state = self.service.tenant_state(tenant_id)
        digest = hashlib.sha256(str(state["version"]).encode())
        for name, tensor in sorted(state["module"].items()):
            digest.update(name.encode())
            digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
        for name, tensor in sorted(state.get("adapter", {}).items()):
            digest.update(f"adapter/{name}".encode())
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


def _on_every_rank(name: str, doc: str) -> Callable[..., Any]:
    def method(self: DataParallelTrainingService, *args: Any, **kwargs: Any) -> Any:
        return self._all(DataParallelRank.call, name, *args, **kwargs)[0]

    method.__name__ = method.__qualname__ = name
    method.__doc__ = doc
    return method


def _on_rank_zero(name: str, doc: str) -> Callable[..., Any]:
    def method(self: DataParallelTrainingService, *args: Any, **kwargs: Any) -> Any:
        return self.ranks[0].call(name, *args, **kwargs)

    method.__name__ = method.__qualname__ = name
    method.__doc__ = doc
    return method


class DataParallelTrainingService:
    """One logical Training Model Service over K rank actors (module docstring): `TrainingModelService`'s
    public methods, state-changing ones on every rank, reads on rank 0, training calls split by rows
    and followed by a check that every rank holds the same state of the tenants they trained.

    Built in a Ray process (the deployment's training actor, or a driver in tests); its ranks are
    actors it owns, each with `rank_options` (the training role's Ray resources), on bundles
    `bundle_offset` .. `bundle_offset + world_size - 1` of `placement_group` when one is given."""

    def __init__(
        self,
        backbone_source: Any,
        checkpoint_root: str,
        queue: Any = None,
        num_threads: int | None = 1,
        *,
        world_size: int,
        rank_options: dict[str, Any] | None = None,
        placement_group: Any = None,
        bundle_offset: int = 0,
        verify_every: int = 1,
        collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S,
        **service_options: Any,
    ) -> None:
        import ray

        from joynexus.actors import HEALTH_GROUP, actor_class, service_handle

        if world_size < 2:
            raise ValueError(f"training_data_parallel: a data-parallel group needs >= 2 ranks, got {world_size}")
        if verify_every < 0:
            raise ValueError(f"verify_every: must be >= 0 (0: never), got {verify_every}")
        self.world_size, self.verify_every = world_size, verify_every
        self.incarnation = uuid.uuid4().hex[:12]
        self.started_at = time.time()
        self._calls = 0
        self._lock = threading.Lock()
        remote = ray.remote(concurrency_groups={HEALTH_GROUP: 1})(actor_class(DataParallelRank))
        actors = []
        for rank in range(world_size):
            options = dict(rank_options or {"num_cpus": 1})
            options["max_restarts"] = 0  # a rank restarted alone would hold no tenants: the group restarts whole
            if placement_group is not None:
                from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

                options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    placement_group, placement_group_bundle_index=bundle_offset + rank
                )
            actors.append(
                remote.options(**options).remote(
                    rank, world_size, backbone_source, checkpoint_root, queue, num_threads, **service_options
                )
            )
        self.ranks = [service_handle(DataParallelRank, a) for a in actors]
        init_method = self.ranks[0].rendezvous()
        backends = self._all(DataParallelRank.join, init_method, collective_timeout_s)
        self.backend = backends[0]

    # -- the group ----------------------------------------------------------------------------
    def _call(self, rank: Any, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        from joynexus.actors import handle_of

        return handle_of(rank).start(method, *args, **kwargs)

    def _all(self, method: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """`method` on every rank at once; their results in rank order. A rank that died ends this
        process (Ray restarts the logical service whole, `_lost_rank`)."""
        futures = [self._call(r, method, *args, **kwargs) for r in self.ranks]
        try:
            return [_result(f) for f in futures]
        except BaseException as error:
            self._lost_rank(error)
            raise

    def _lost_rank(self, error: BaseException) -> None:
        from joynexus.actors import role_unavailable_errors

        if isinstance(error, role_unavailable_errors()) and _in_ray_actor():
            os._exit(1)  # the ranks left hold tenants a new rank would not: start over (module docstring)

    def _verified(self, tenant_ids: Sequence[str]) -> None:
        """Every rank holds the same state of `tenant_ids` (every `verify_every`-th training call)."""
        with self._lock:
            self._calls += 1
            due = self.verify_every and self._calls % self.verify_every == 0
        if due:
            self._compare_ranks(tenant_ids)

    def _compare_ranks(self, tenant_ids: Sequence[str]) -> None:
        for tenant_id in dict.fromkeys(tenant_ids):
            digests = self._all(DataParallelRank.state_digest, tenant_id)
            if len(set(digests)) != 1:
                raise RankStateDiverged(
                    f"tenant {tenant_id!r}: {len(set(digests))} different states over the {self.world_size} ranks"
                )

    def state_digests(self, tenant_id: str) -> list[str]:
        """Each rank's digest of the tenant's state (`DataParallelRank.state_digest`), in rank order."""
        return self._all(DataParallelRank.state_digest, tenant_id)

    def heartbeat(self) -> dict[str, Any]:
        """Rank 0's answer under this group's incarnation, with every rank's pid; a rank whose actor
        died ends this process (Ray restarts the group, the Health Manager then sees a new life)."""
        from joynexus.actors import handle_of

        answers = []
        for rank in self.ranks:
            try:
                answers.append(handle_of(rank).probe("heartbeat", 10.0))
            except BaseException as error:
                self._lost_rank(error)
                raise
        return {
            **answers[0],
            "incarnation": self.incarnation,
            "started_at": self.started_at,
            "pid": os.getpid(),
            "data_parallel": {
                "world_size": self.world_size,
                "backend": self.backend,
                "rank_pids": [a["pid"] for a in answers],
            },
        }

    # -- training (rows split, state verified) ------------------------------------------------
    def train_group(self, batches: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
        """`TrainingModelService.train_group`, each tenant's microbatch split across the ranks
        (each needs >= K rows)."""
        for tenant_id, batch in batches:
            rows = len(batch.get("task", []))
            if rows < self.world_size:
                raise ValueError(
                    f"train_group: tenant {tenant_id!r}'s microbatch has {rows} rows; "
                    f"a data-parallel group of {self.world_size} ranks needs >= {self.world_size}"
                )
        results = self._all(DataParallelRank.train_group, batches)[0]
        self._verified([t for t, _ in batches])
        return results

    def train_batch(self, tenant_id: str, batch: dict[str, Any]) -> dict[str, Any]:
        rows = len(batch.get("task", []))
        if rows < self.world_size:
            raise ValueError(
                f"train_batch: the microbatch has {rows} rows; a data-parallel group of "
                f"{self.world_size} ranks needs >= {self.world_size}"
            )
        result = self._all(DataParallelRank.train_batch, tenant_id, batch)[0]
        self._verified([tenant_id])
        return result

    def train_job(self, job: Any) -> dict[str, Any]:
        """`TrainingModelService.train_job` on every rank, an SFT job's microbatches split by rows."""
        result = self._all(DataParallelRank.train_job, job)[0]
        self._verified([_tenant_of(job)])
        return result

    def train_jobs(self, jobs: list[Any]) -> list[dict[str, Any]]:
        results = self._all(DataParallelRank.train_jobs, jobs)[0]
        self._verified([r["tenant_id"] for r in results if "error" not in r])
        return results

    # -- state changes: every rank -------------------------------------------------------------
    def add_tenant(self, config: Any, resume: bool = True) -> dict[str, Any]:
        """`TrainingModelService.add_tenant` on every rank, each resuming from the group's
        checkpoints; the ranks' states are then compared (they must be the same)."""
        result = self._all(DataParallelRank.call, "add_tenant", config, resume)[0]
        if self.verify_every:
            self._compare_ranks([_tenant_of(config)])
        return result

    remove_tenant = _on_every_rank("remove_tenant", "`TrainingModelService.remove_tenant` on every rank.")
    page_out_tenant = _on_every_rank("page_out_tenant", "The slot out of every rank; rank 0's paging bytes.")
    page_in_tenant = _on_every_rank("page_in_tenant", "A paged-out slot into every rank.")
    save = _on_every_rank("save", "Checkpoint (rank 0 writes the group's folder, `RankCheckpoints`).")
    fork_checkpoint = _on_rank_zero("fork_checkpoint", "Rank 0 writes the fork's v0 (every rank reads it on add).")
    install_weights = _on_every_rank("install_weights", "`TrainingModelService.install_weights` on every rank.")
    forward_backward = _on_every_rank("forward_backward", "Whole microbatch on every rank (gradients averaged).")
    optim_step = _on_every_rank("optim_step", "`TrainingModelService.optim_step` on every rank.")
    load_state = _on_every_rank("load_state", "`TrainingModelService.load_state` on every rank.")
    discard_pending_gradients = _on_every_rank(
        "discard_pending_gradients", "`TrainingModelService.discard_pending_gradients` on every rank."
    )

    # -- reads: rank 0 -------------------------------------------------------------------------
    backbone_info = _on_rank_zero("backbone_info", "Rank 0's backbone (every rank holds a replica).")
    capabilities = _on_rank_zero("capabilities", "`TrainingModelService.capabilities`.")
    tenants = _on_rank_zero("tenants", "`TrainingModelService.tenants`.")
    policy_version = _on_rank_zero("policy_version", "`TrainingModelService.policy_version`.")
    tenant_status = _on_rank_zero("tenant_status", "`TrainingModelService.tenant_status`.")
    tenant_state = _on_rank_zero("tenant_state", "`TrainingModelService.tenant_state`.")
    residency_stats = _on_rank_zero("residency_stats", "`TrainingModelService.residency_stats`.")
    slot_bytes = _on_rank_zero("slot_bytes", "`TrainingModelService.slot_bytes` (one rank's).")
    encode = _on_rank_zero("encode", "`TrainingModelService.encode` on rank 0.")
    export_params = _on_rank_zero("export_params", "`TrainingModelService.export_params`.")
    sample = _on_rank_zero("sample", "`TrainingModelService.sample` on rank 0 (no state changes).")
    compute_logprobs = _on_rank_zero("compute_logprobs", "`TrainingModelService.compute_logprobs` on rank 0.")

    def close(self) -> None:
        """Leave the process group and end the ranks (a driver-owned group; an actor's ends with it)."""
        from joynexus.actors import handle_of

        try:
            self._all(DataParallelRank.close)
        finally:
            for rank in self.ranks:
                handle_of(rank).kill(restart=False)


def _result(future: Any) -> Any:
    """A rank's result; the service's own exception raised as a local call would (not Ray's wrapper)."""
    from ray.exceptions import RayTaskError

    try:
        return future.result()
    except RayTaskError as error:
        cause = getattr(error, "cause", None)
        if isinstance(cause, Exception):
            raise cause from None
        raise


def _tenant_of(job: Any) -> str:
    return job["tenant_id"] if isinstance(job, dict) else job.tenant_id


def _in_ray_actor() -> bool:
    try:
        import ray

        return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None
    except Exception:
        return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]
