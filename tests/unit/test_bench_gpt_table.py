"""``benchmarks/bench_gpt.py``'s results table: every system's row carries its peak allocated and
peak reserved memory side by side (reserved is what runs out first on a full GPU, issue 63), and a
system measured on CPU, where neither counter exists, shows "-" for both."""

from tests.benchmark_modules import load_benchmark_module

load_benchmark_module("bench_setup")
bench_gpt = load_benchmark_module("bench_gpt")

META = dict(num_params=941_000_000, fake=False, world=1, real_world=1, backend="nccl", layers=16, hidden=2048,
            heads=16, seq=2048, micro_batch=4, vocab=32000, device_name="NVIDIA H200", torch="2.13",
            megatron_core="0.19.2", python="3.12", date="2026-12-08 10:00", steps=20, warmup=3, notes=[])


def _row(name, **memory):
    return dict(name=name, status="ok", step_ms=300.0, tokens_per_s=27000.0, expected_formula="(4+4+8)/N",
                notes=[], **memory)


def test_each_row_has_peak_allocated_and_peak_reserved_side_by_side():
    table = bench_gpt.results_markdown(META, [_row("fsdp2-zero3", peak_gib=46.58, reserved_gib=55.99),
                                              _row("ours-cpu")])
    lines = table.splitlines()
    header = next(line for line in lines if line.startswith("| system |"))
    cells = [c.strip() for c in header.strip("|").split("|")]
    assert cells[5:7] == ["peak allocated GiB", "peak reserved GiB"], cells
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.strip("|").split("|")]
            for line in lines if line.startswith(("| fsdp2-zero3 |", "| ours-cpu |"))}
    assert rows["fsdp2-zero3"][5:7] == ["46.58", "55.99"]
    assert rows["ours-cpu"][5:7] == ["-", "-"]
    assert all(len(r) == len(cells) for r in rows.values())
    assert "max_memory_allocated / max_memory_reserved over the warm-up and timed steps" in table
