"""Training Queue: partitions, two-step meta/data reads, derived-field write-back, sharing via Ray."""

from __future__ import annotations

import numpy as np
import pytest

from joynexus.scheduling.training_queue import TrainingQueue, TrainingQueueError, UnknownPartition


def test_put_get_meta_get_data_in_order_until_exhausted():
    q = TrainingQueue()
    q.put("p", {"x": np.arange(5, dtype=np.float32), "task": list("abcde")}, annotations={"tenant_id": "t1"})
    q.put("p", {"x": np.arange(5, 7, dtype=np.float32), "task": ["f", "g"]})
    metas = []
    while (meta := q.get_meta("p", ["x", "task"], batch_size=3)) is not None:
        metas.append(meta)
    assert [m.indices for m in metas] == [(0, 1, 2), (3, 4, 5), (6,)]
    data = q.get_data(metas[1])
    assert data["x"].tolist() == [3, 4, 5] and data["task"] == ["d", "e", "f"]
    assert q.describe("p")["annotations"] == {"tenant_id": "t1"}


def test_get_meta_reads_in_a_given_order_and_refuses_one_that_is_not_a_permutation():
    q = TrainingQueue()
    q.put("p", {"x": np.arange(5, dtype=np.float32)})
    order = [3, 0, 4, 1, 2]
    metas = []
    while (meta := q.get_meta("p", ["x"], batch_size=2, task_name="epoch-0", order=order)) is not None:
        metas.append(meta)
    assert [m.indices for m in metas] == [(3, 0), (4, 1), (2,)]
    assert q.get_data(metas[0])["x"].tolist() == [3.0, 0.0]
    for bad in ([0, 1, 2, 3], [0, 1, 2, 3, 3], [0, 1, 2, 3, 5]):
        with pytest.raises(TrainingQueueError, match="order: expected a permutation of the 5"):
            q.get_meta("p", ["x"], batch_size=2, task_name="epoch-1", order=bad)


def test_cursors_are_per_task_and_derived_fields_write_back():
    q = TrainingQueue()
    q.put("p", {"reward": np.ones(4, dtype=np.float32)})
    meta = q.get_meta("p", ["reward"], batch_size=4, task_name="compute_advantages")
    q.put("p", {"advantage": np.full(4, 2.0, dtype=np.float32)}, metadata=meta)
    train = q.get_meta("p", ["reward", "advantage"], batch_size=10, task_name="train")
    assert train.indices == (0, 1, 2, 3)
    assert q.get_data(train)["advantage"].tolist() == [2.0] * 4


def test_bad_puts_and_unknown_partitions_are_clear_errors():
    q = TrainingQueue()
    with pytest.raises(TrainingQueueError, match="same number of rows"):
        q.put("p", {"a": np.zeros(2), "b": np.zeros(3)})
    q.put("p", {"a": np.zeros((2, 3))})
    with pytest.raises(TrainingQueueError, match="row shape"):
        q.put("p", {"a": np.zeros((2, 4))})
    with pytest.raises(TrainingQueueError, match="differ"):
        q.put("p", {"b": np.zeros(2)})
    q.put("p2", {"a": [1]}, annotations={"tenant_id": "t1"})
    with pytest.raises(TrainingQueueError, match="annotation"):
        q.put("p2", {"a": [1]}, annotations={"tenant_id": "t2"})
    with pytest.raises(UnknownPartition):
        q.get_meta("nope", ["a"], 1)


def test_clear_is_idempotent():
    q = TrainingQueue()
    q.put("p", {"a": [1]})
    assert q.clear("p") is True
    assert q.clear("p") is False
    assert q.partitions() == []
