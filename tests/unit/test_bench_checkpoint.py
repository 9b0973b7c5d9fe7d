"""``benchmarks/bench_checkpoint.py --tiny`` (issue 64) runs end to end on CPU, as a user runs it:
ours and FSDP2 + DCP each save asynchronously (ours twice), synchronously and load; both resharding
loads run in torch's fake 8-way group; every number the GPU run reports is there."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="bench_checkpoint.py builds Hugging Face's LlamaForCausalLM")

REPO = Path(__file__).resolve().parents[2]


def test_the_tiny_run_measures_every_phase_of_both_systems(tmp_path):
    out = tmp_path / "results.json"
    done = subprocess.run([sys.executable, "benchmarks/bench_checkpoint.py", "--tiny", "--dir", str(tmp_path / "ckpt"),
                           "--json", str(out), "--out", str(tmp_path / "results.md")],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    assert sorted(results) == ["fsdp2", "ours", "reshard-fsdp2", "reshard-ours"]
    for kind, rounds in (("ours", ("async_first", "async_second")), ("fsdp2", ("async_first",))):
        r = results[kind]
        assert r["skipped"] == [] and r["step_s"] > 0 and r["sync_save_s"] > 0 and r["load_s"] > 0, r
        for name in rounds:
            assert 0 < r[name]["blocking_s"] <= r[name]["complete_s"], r[name]
            assert r[name]["staging_gpu_gib"] is None and r[name]["staging_gpu_reserved_gib"] is None  # CPU
        assert r["peak_gib"] is None and r["reserved_gib"] is None          # no CUDA counters on CPU
    assert results["ours"]["staging_host_gib"] == pytest.approx(results["ours"]["state_gib"], rel=0.01)
    assert all(results[k]["load_s"] > 0 for k in ("reshard-ours", "reshard-fsdp2"))
    table = (tmp_path / "results.md").read_text()
    assert "| ours async blocking / ours sync save <= 0.1 |" in table
    assert "GPU allocated / reserved GiB |" in table and "| peak allocated / reserved GiB |" in table
    ours_row = next(line for line in table.splitlines() if line.startswith("| ours |"))
    assert ours_row.endswith("| - / - |"), ours_row
    assert not (tmp_path / "ckpt").exists()         # every checkpoint deleted
