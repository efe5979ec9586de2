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
