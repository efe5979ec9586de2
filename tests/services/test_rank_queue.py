"""A data-parallel rank's view of the Training Queue (issue 45.2, `data_parallel.RankQueue`): each rank
reads a job's partition on its own cursor, keeps its contiguous chunk of every SFT microbatch and sets
the tenant's gradient weight to that chunk's share; an RL partition (not split) reads whole, weighted
1/K by the reducer's default; the chunks of all ranks are the whole microbatch, each row once."""

from __future__ import annotations

import numpy as np
import pytest

from joynexus.scheduling.training_queue import TrainingQueue
from joynexus.scheduling.training_scheduler import TrainingJob
from joynexus.services.training.data_parallel import RankQueue
from joynexus.services.training.gradient_sync import WeightedAllReduce

FIELDS = ("state", "task")


def _job(partition: str, tenant: str, task_type: str = "sft") -> TrainingJob:
    return TrainingJob(
        job_id=f"job-{partition}", policy_key=f"{tenant}:{task_type}", tenant_id=tenant, task_type=task_type,
        partition_id=partition, sample_count=7, domain="vla", metadata={}, priority=0, created_seq=0, ready_seq=0,
        behavior_policy_version=None, max_policy_staleness=1, producer_role="p", consumer_role="actor",
        state="leased", lease_owner="actor", terminal_reason=None,
    )  # fmt: skip


@pytest.fixture
def queue():
    q = TrainingQueue()
    q.put("vla/t/sft/1", {"state": np.arange(7, dtype=np.float32)[:, None], "task": [f"s{i}" for i in range(7)]})
    q.put("vla/t/rl/2", {"state": np.arange(5, dtype=np.float32)[:, None], "task": [f"r{i}" for i in range(5)]})
    return q


def _read_all(view: RankQueue, partition: str, batch: int) -> list[dict]:
    out = []
    while (meta := view.get_meta(partition, FIELDS, batch, "train")) is not None:
        out.append((view.get_data(meta), dict(view.reducer.weights)))
    return out


def test_the_ranks_chunks_are_each_microbatch_once_with_their_shares(queue):
    views = [RankQueue(queue, rank, 2, WeightedAllReduce(default_weight=0.5)) for rank in range(2)]
    reads = []
    for view in views:
        view.begin([_job("vla/t/sft/1", "t")])
        reads.append(_read_all(view, "vla/t/sft/1", 4))  # microbatches of 4 and 3 rows
    # Rank 0 keeps rows [0, 1] of the first microbatch and [4, 5] of the second; rank 1 the rest.
    assert [d["task"] for d, _ in reads[0]] == [["s0", "s1"], ["s4", "s5"]]
    assert [d["task"] for d, _ in reads[1]] == [["s2", "s3"], ["s6"]]
    assert [w["t"] for _, w in reads[0]] == [0.5, pytest.approx(2 / 3)]
    assert [w["t"] for _, w in reads[1]] == [0.5, pytest.approx(1 / 3)]
    assert views[0].shares["vla/t/sft/1"] == [0.5, pytest.approx(2 / 3)]
    assert views[0].rows_not_seen == {"t": 3} and views[1].rows_not_seen == {"t": 4}
    # Each rank read on its own cursor: the partition was read whole twice.
    cursors = queue.describe("vla/t/sft/1")["cursors"]
    assert cursors == {"train/rank-0": 7, "train/rank-1": 7}
    for view in views:
        view.end()
        assert view.reducer.weights == {}  # the reducer's default (1/K) again


def test_an_rl_partition_and_a_too_small_microbatch_are_read_whole(queue):
    view = RankQueue(queue, 1, 3, WeightedAllReduce(default_weight=1 / 3))
    view.begin([_job("vla/t/sft/1", "t"), _job("vla/t/rl/2", "t", "rl")][:1])  # only SFT jobs are split
    whole = _read_all(view, "vla/t/rl/2", 5)
    assert [d["task"] for d, _ in whole] == [[f"r{i}" for i in range(5)]]
    # 7 rows in microbatches of 6 and 1: the 1-row one cannot be split over 3 ranks, every rank steps it.
    chunks = _read_all(view, "vla/t/sft/1", 6)
    assert [d["task"] for d, _ in chunks] == [["s2", "s3"], ["s6"]]
    assert view.shares["vla/t/sft/1"] == [pytest.approx(1 / 3), pytest.approx(1 / 3)]
    assert view.rows_not_seen == {"t": 4}


def test_the_data_parallel_setting_is_checked_by_name(tmp_path):
    from pydantic import ValidationError

    from joynexus.master.deployment import Deployment
    from joynexus.services.training.data_parallel import DataParallelTrainingService
    from joynexus.settings import Settings

    with pytest.raises(ValidationError, match="training_data_parallel"):
        Settings(data_dir=tmp_path, training_data_parallel=0)
    # Ranks are processes: an in-process deployment says so instead of running one device silently.
    with pytest.raises(ValueError, match="training_data_parallel: 2 ranks need a Ray deployment"):
        Deployment.in_process(Settings(data_dir=tmp_path, training_data_parallel=2))
    with pytest.raises(ValueError, match="needs >= 2 ranks"):
        DataParallelTrainingService(None, str(tmp_path), world_size=1)
