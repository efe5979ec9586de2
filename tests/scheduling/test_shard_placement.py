"""Placement of tenants on Training Model Service shards (issue 45.1): sticky, group-compatible
tenants together up to a grouped step's size, then the least loaded shard (measured seconds), the
memory bound, lost shards, and the guard that keeps a tenant's jobs on one shard at a time."""

from __future__ import annotations

import threading
import time

import pytest

from joynexus.scheduling.shard_placement import PlacementError, ShardPlacement, ShardsFull


def test_placement_is_sticky_and_fills_groups_before_spreading():
    placement = ShardPlacement(4, group_size=3)
    shards = [placement.place(f"g{i}", "arm") for i in range(12)]
    # A group fills a shard up to the grouped step's size, then the next (least loaded) shard starts.
    assert shards == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert placement.place("g0", "arm") == 0 and placement.place("g0", "other") == 0  # sticky
    assert [s["tenants"] for s in placement.summary()] == [3, 3, 3, 3]


def test_two_groups_stay_together_on_their_own_shards():
    placement = ShardPlacement(2, group_size=4)
    for i in range(4):
        placement.place(f"a{i}", "A")
        placement.place(f"b{i}", "B")
    by_shard = [set(placement.tenants_of(s)) for s in range(2)]
    assert {frozenset(s) for s in by_shard} == {
        frozenset(f"a{i}" for i in range(4)),
        frozenset(f"b{i}" for i in range(4)),
    }


def test_new_tenants_go_to_the_least_loaded_shard_by_measured_seconds():
    placement = ShardPlacement(2, group_size=1)
    assert placement.place("slow", "x") == 0 and placement.place("fast", "y") == 1
    placement.record_training("slow", 4.0)
    placement.record_training("fast", 0.5)
    # Shard 1 carries 0.5 s per round, shard 0 4 s: new tenants (counted at the measured mean, 2.25 s
    # each until their own first job) go to shard 1 until it carries more than shard 0.
    assert [placement.place(f"n{i}", f"k{i}") for i in range(3)] == [1, 1, 0]
    assert placement.load(1) == pytest.approx(0.5 + 2 * 2.25)


def test_memory_and_count_bounds_refuse_with_the_limits_named():
    placement = ShardPlacement(2, max_bytes_per_shard=100, max_tenants_per_shard=2, group_size=1)
    assert placement.place("a", "k", nbytes=80) == 0
    assert placement.place("b", "k", nbytes=80) == 1
    assert placement.place("c", "k", nbytes=20) == 0  # equal load and bytes: the lower index
    assert placement.place("d", "k", nbytes=20) == 1
    with pytest.raises(ShardsFull, match="max_tenants_per_shard=2"):
        placement.place("e", "k", nbytes=1)
    placement.update_bytes("a", 150)  # a slot grew: its shard is over its bound
    # 170 bytes on shard 0: the smallest tenants first until it is back under its bound.
    assert placement.over_bytes() == [("c", 0), ("a", 0)]


def test_a_lost_shard_leases_nothing_and_its_tenants_are_placed_elsewhere():
    placement = ShardPlacement(3, group_size=2)
    for i in range(6):
        placement.place(f"t{i}", "k")
    lost = placement.lose(1)
    assert lost == sorted(lost) and len(lost) == 2
    with placement.leasing(1) as tenants:
        assert tenants == frozenset()
    assert all(placement.place(t, "k") in (0, 2) for t in lost)
    assert placement.live_shards() == [0, 2]
    with pytest.raises(PlacementError):
        placement.begin(lost[0], 1)  # a loop of the lost shard cannot count a job in flight there


def test_a_moving_tenant_is_leasable_nowhere_and_waits_for_its_job_and_open_windows():
    placement = ShardPlacement(2, group_size=1)
    placement.place("m", "k")
    placement.place("other", "j")
    source = placement.shard_of("m")
    window = placement.leasing(source)
    tenants = window.__enter__()  # a loop opened its lease window before the move began
    assert "m" in tenants
    placement.start_move("m")
    with placement.leasing(source) as later:
        assert "m" not in later  # windows opened after the move began never see it
    placement.begin("m", source)  # the early window leased a job of it
    window.__exit__(None, None, None)
    assert placement.wait_idle("m", timeout_s=0.05) is False  # the job is still in flight

    done = threading.Event()

    def wait() -> None:
        assert placement.wait_idle("m", timeout_s=5.0)
        done.set()

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.05)
    assert not done.is_set()
    placement.end("m", source)
    waiter.join(5.0)
    assert done.is_set()
    placement.finish_move("m", 1 - source)
    assert placement.shard_of("m") == 1 - source
    with placement.leasing(1 - source) as tenants:
        assert "m" in tenants
