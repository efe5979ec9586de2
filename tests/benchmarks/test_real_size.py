"""benchmarks/real_size.py in --quick mode on the tiny preset: every part runs and reports its
side-by-side ratios in the printed output and the JSON file."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "real_size.py"


@pytest.fixture()
def real_size():
    spec = importlib.util.spec_from_file_location("real_size_under_test", _PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    threads = torch.get_num_threads()
    yield module
    torch.set_num_threads(threads)  # the benchmark sets its own
    sys.modules.pop(spec.name, None)


def test_quick_run_on_tiny_reports_every_part(real_size, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    # In process (the session's imports are reused): the same `main` the command line runs.
    real_size.main(["--preset", "tiny", "--image-size", "48", "--quick", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    for heading in ("== tiny:", "== 1. group batching", "== 2. memory", "== 3. peer", "== table (issue 23)"):
        assert heading in out, heading
    report = json.loads((tmp_path / "real_size.json").read_text())
    assert (report["preset"], report["image_size"], report["threads"]) == ("tiny", 48, 1)
    assert report["parameters"] > 0 and set(report["load_average"]) == {"before", "after"}

    for mix in ("oft_mlp", "flow_matching", "lora"):
        r = report["group_batching"][mix]
        assert (r["tenants"], r["batch"]) == (8, 1)
        for ratio in ("speedup", "bound", "share", "efficiency"):
            point, low, high = r[ratio]
            assert 0 < low <= point <= high, (mix, ratio, r[ratio])
        assert r["grouped_rps"] > 0 and r["serial_rps"] > 0
        assert r["speedup"][0] == pytest.approx(r["serial_ms"] / r["grouped_ms"])

    memory = report["memory"]
    assert memory["backbone_bytes"]["bfloat16"] < memory["backbone_bytes"]["float32"]
    # A LoRA tenant holds its head and its adapter: more than the same head alone.
    assert memory["tenant_bytes"]["lora"] > memory["tenant_bytes"]["oft_mlp"] > 0
    rows = {(r["dtype"], r["mix"], r["n"]): r for r in memory["rows"]}
    assert len(rows) == 2 * 3 * 3
    one, thousand = rows[("float32", "oft_mlp", 1)], rows[("float32", "oft_mlp", 1000)]
    assert one["ratio"] == 1.0 and thousand["ratio"] > one["ratio"]
    assert thousand["separate_bytes"] == 1000 * one["separate_bytes"]

    peer = report["peer"]
    assert peer["copies"] == 2 and peer["peer_rps"] > 0 and peer["grouped_rps"] > 0
    assert peer["memory_ratio"] > 1
    assert peer["peer_bytes"] - peer["joynexus_bytes"] == memory["backbone_bytes"]["float32"]


def test_grid_only_fills_its_results_file_over_runs(real_size, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    # The P1 grid is hours at real size on a CPU: a run appends each cell to --grid-results as it is
    # measured and a later run measures only the cells the file lacks, then tables them all.
    results = tmp_path / "grid.jsonl"
    common = ["--preset", "tiny", "--image-size", "48", "--quick", "--grid-only", "--grid-mixes", "oft_mlp",
              "--grid-tenants", "2", "--grid-results", str(results), "--out", str(tmp_path)]  # fmt: skip
    first = real_size.main([*common, "--grid-batches", "1"])
    assert [(r["mix"], r["tenants"], r["batch"]) for r in first["grid"]] == [("oft_mlp", 2, 1)]
    assert len(results.read_text().splitlines()) == 1
    capsys.readouterr()

    with results.open("a") as f:
        f.write('{"torn": ')  # a run stopped while writing: ignored, nothing else lost
    second = real_size.main([*common, "--grid-batches", "1,2"])
    out = capsys.readouterr().out
    assert "N=2 b=1: in" in out  # not measured again
    cells = {(r["tenants"], r["batch"]): r for r in second["grid"]}
    assert set(cells) == {(2, 1), (2, 2)}
    assert cells[(2, 1)]["measured_at"] == first["grid"][0]["measured_at"]
    assert "== P1 grid table: tiny @ 48 px" in out and "2 cells" in out
    for r in cells.values():
        for ratio in ("speedup", "bound", "share", "bare_bound"):
            point, low, high = r[ratio]
            assert 0 < low <= point <= high, (r["batch"], ratio, r[ratio])
    # Another side is another grid: nothing of this file counts for it.
    third = real_size.main([*common[:3], "32", *common[4:], "--grid-batches", "1"])
    assert [r["image_size"] for r in third["grid"]] == [32]
