"""``benchmarks/peak_breakdown.py``'s analysis on synthetic memory snapshots (no GPU, no Megatron).

The snapshots have the layout of ``torch.cuda.memory._snapshot()``: ``segments`` with ``blocks``
(``address``, ``size``, ``requested_size``, ``state``, ``frames``) and ``device_traces`` of events
(``action``, ``addr``, ``size``, ``frames``, innermost frame first).
"""

from __future__ import annotations

import pytest

from tests.benchmark_modules import load_benchmark_module


pb = load_benchmark_module("peak_breakdown")

OURS = "/repo/megatron_fsdp_v2/"
FSDP = "/venv/lib/python3.12/site-packages/torch/distributed/fsdp/_fully_shard/"
MCORE = "/site/megatron/core/transformer/"
OPTIM = "/venv/lib/python3.12/site-packages/torch/optim/"
BENCH = "/repo/benchmarks/"


def fr(path, name, line=1):
    return {"filename": path, "name": name, "line": line}


def stack(*frames):
    """Innermost first, ending in the benchmark's step, as torch records a Python stack."""
    return list(frames) + [fr(BENCH + "bench_systems.py", "fwd_bwd"), fr(BENCH + "peak_breakdown.py", "run_system")]


def marker(phase):
    size = pb.MARKER_UNIT * (pb.PHASES.index(phase) + 1)
    frames = [fr(BENCH + "peak_breakdown.py", pb.MARKER_FUNCTION), fr(BENCH + "peak_breakdown.py", "run_system")]
    addr = 9_000_000 + pb.PHASES.index(phase) * 1024
    return [dict(action="alloc", addr=addr, size=size, frames=frames),
            dict(action="free_requested", addr=addr, size=size, frames=frames),
            dict(action="free_completed", addr=addr, size=size, frames=frames)]


def alloc(addr, size, frames):
    return dict(action="alloc", addr=addr, size=size, frames=frames)


def free(addr, size, completed=True):
    out = [dict(action="free_requested", addr=addr, size=size, frames=[])]
    if completed:
        out.append(dict(action="free_completed", addr=addr, size=size, frames=[]))
    return out


def block(addr, size, frames, state="active_allocated"):
    return dict(address=addr, size=size + 100, requested_size=size, state=state, frames=frames)


HELD_PARAM = block(1, 1000, stack(fr(OURS + "group/param_group.py", "__init__")))
HELD_ADAM = block(2, 2000, stack(fr(OPTIM + "adamw.py", "_init_group")))
HELD_FREED_IN_FWD = block(3, 700, stack(fr(OURS + "group/param_group.py", "grad_shard")))


def step_trace():
    """forward: unshard 4000 (ours), activation 3000 (Megatron), reshard, free a held 700;
    backward: autograd 5000 (no frames), unshard 4000 -> peak; optimizer: 500 temp."""
    unshard = stack(fr(OURS + "group/param_group.py", "unshard"), fr(MCORE + "transformer_layer.py", "forward"))
    act = stack(fr("/venv/lib/python3.12/site-packages/torch/nn/functional.py", "gelu"),
                fr(MCORE + "mlp.py", "forward"))
    ev = []
    ev += marker("forward")
    ev += [alloc(10, 4000, unshard), alloc(11, 3000, act)]
    ev += free(10, 4000)
    ev += free(3, 700)                   # a block live before the step
    ev += marker("backward")
    ev += [alloc(12, 5000, []), alloc(13, 4000, unshard)]
    ev += free(13, 4000) + free(11, 3000, completed=False) + free(12, 5000)
    ev += [dict(action="free_completed", addr=11, size=3000, frames=[])]   # completed later (other stream)
    ev += marker("optimizer.step")
    ev += [alloc(14, 500, stack(fr(OPTIM + "adamw.py", "_fused_adamw")))] + free(14, 500)
    ev += marker("zero_grad") + marker("end")
    ev += [dict(action="snapshot", addr=0, size=0, frames=[])]
    return ev


def snapshot(trace, blocks):
    return {"segments": [{"device": 0, "address": 0, "total_size": 1 << 20, "blocks": blocks}],
            "device_traces": [trace]}


def by_label(result):
    return {(c["origin"], c["label"]): (c["count"], c["bytes"]) for c in result["categories"]}


def test_peak_with_start_blocks():
    end = snapshot(step_trace(), [HELD_PARAM, HELD_ADAM, block(50, 0, [], state="inactive")])
    r = pb.analyze_step(end, start_blocks=[HELD_PARAM, HELD_ADAM, HELD_FREED_IN_FWD], baseline_bytes=3700)
    assert r["start_bytes"] == 3700 and r["unattributed_bytes"] == 0
    assert r["peak_bytes"] == 1000 + 2000 + 3000 + 5000 + 4000
    assert r["phase_at_peak"] == "backward"
    assert r["phase_peaks"]["forward"] == 3700 + 4000 + 3000
    assert r["phase_peaks"]["optimizer.step"] == 3000 + 3 * pb.MARKER_UNIT   # its marker, then 500
    assert r["end_bytes"] == r["end_check_bytes"] == 3000
    assert r["held_at_peak"] == 3000 and r["step_at_peak"] == 12000
    assert by_label(r) == {
        ("step", "autograd engine (no Python frames)"): (1, 5000),
        ("step", "ours param_group.py:unshard"): (1, 4000),
        ("step", "megatron mlp.py:forward"): (1, 3000),
        ("held", "optimizer adamw.py:_init_group"): (1, 2000),
        ("held", "ours param_group.py:__init__"): (1, 1000),
    }
    assert [c["bytes"] for c in r["categories"]] == [5000, 4000, 3000, 2000, 1000]
    assert r["groups"] == {"step: autograd": 5000, "step: ours": 4000, "step: megatron": 3000,
                           "held: optimizer": 2000, "held: ours": 1000}
    assert r["peak_alloc"]["bytes"] == 4000 and r["peak_alloc"]["label"] == "ours param_group.py:unshard"
    assert r["top_allocations"][0]["bytes"] == 5000
    assert r["top_allocations"][1]["stack"][:2] == ["param_group.py:1:unshard", "transformer_layer.py:1:forward"]
    assert r["warnings"] == []


def test_held_blocks_derived_from_the_end_snapshot_and_baseline():
    """Without a start snapshot: held = end blocks not allocated in the step + blocks the step
    freed without allocating them; what the baseline holds beyond them is unattributed."""
    end = snapshot(step_trace(), [HELD_PARAM, HELD_ADAM])
    r = pb.analyze_step(end, baseline_bytes=1000 + 2000 + 700 + 300)
    assert r["unattributed_bytes"] == 300
    assert r["peak_bytes"] == 1000 + 2000 + 300 + 3000 + 5000 + 4000
    assert r["phase_at_peak"] == "backward"
    labels = by_label(r)
    assert labels[("held", "unattributed (live before the step, no block)")] == (1, 300)
    assert ("held", "no stack (allocated before recording)") not in labels   # the 700 B block was freed
    assert r["end_bytes"] == r["end_check_bytes"] == 3300


def test_trace_without_markers_and_earlier_events():
    """Events before the last forward marker (history not cleared) are not the step; with no
    marker at all the whole trace is, and the phase is guessed from the peak's stack."""
    earlier = [alloc(77, 123, []), dict(action="free_requested", addr=77, size=123, frames=[])]
    end = snapshot(earlier + marker("forward") + earlier + step_trace(), [HELD_PARAM, HELD_ADAM])
    r = pb.analyze_step(end, start_blocks=[HELD_PARAM, HELD_ADAM, HELD_FREED_IN_FWD])
    assert r["peak_bytes"] == 15000 and r["events"] == len(step_trace())

    opt_only = [alloc(5, 800, stack(fr(OPTIM + "adamw.py", "step")))] + free(5, 800)
    r = pb.analyze_step(snapshot(opt_only, []), start_blocks=[])
    assert r["peak_bytes"] == 800 and r["phase_at_peak"].startswith("optimizer.step")
    assert any("no phase markers" in w for w in r["warnings"])


@pytest.mark.parametrize("frames, origin, expected", [
    ([fr(FSDP + "_fsdp_collectives.py", "foreach_all_gather"), fr(MCORE + "attention.py", "forward")], "step",
     ("fsdp2", "fsdp2 _fsdp_collectives.py:foreach_all_gather")),
    # the innermost owning frame wins: our hook inside Megatron's forward is ours
    ([fr("/t/torch/_tensor.py", "new_empty"), fr(OURS + "runtime/engine.py", "pre_forward"),
      fr(MCORE + "transformer_block.py", "forward")], "step", ("ours", "ours engine.py:pre_forward")),
    # ours' buffer allocators name their caller
    ([fr(OURS + "allocators/storage_freeing.py", "_allocate"), fr(OURS + "allocators/base.py", "allocate"),
      fr(OURS + "group/param_group.py", "unshard"), fr(MCORE + "mlp.py", "forward")], "step",
     ("ours", "ours param_group.py:unshard")),
    ([fr(OURS + "allocators/base.py", "allocate"), fr(MCORE + "mlp.py", "forward")], "step",
     ("ours", "ours base.py:allocate")),
    ([fr("/v/lib/python3.12/site-packages/torch/autograd/__init__.py", "backward"),
      fr(BENCH + "bench_systems.py", "fwd_bwd")], "step", ("autograd", "autograd (backward, Python caller)")),
    ([fr("/v/lib/python3.12/site-packages/torch/nn/modules/module.py", "_call_impl"),
      fr(BENCH + "bench_setup.py", "make_batch")], "held", ("user", "user bench_setup.py:make_batch")),
    ([], "held", ("unknown", "no stack (allocated before recording)")),
    ([], "step", ("autograd", "autograd engine (no Python frames)")),
    ([fr("C:\\x\\megatron\\core\\models\\gpt\\gpt_model.py", "forward")], "step",
     ("megatron", "megatron gpt_model.py:forward")),
])
def test_categorize(frames, origin, expected):
    assert pb.categorize(frames, origin) == expected


def test_markdown_side_by_side():
    end = snapshot(step_trace(), [HELD_PARAM, HELD_ADAM])
    a = pb.analyze_step(end, start_blocks=[HELD_PARAM, HELD_ADAM, HELD_FREED_IN_FWD])
    b = pb.analyze_step(end, baseline_bytes=4000)
    results = [dict(name="ours", description="d", status="ok", analysis=a, requested_peak_bytes=a["peak_bytes"],
                    max_allocated_bytes=a["peak_bytes"] + 512, step_s=0.1, build_warmup_s=1.0),
               dict(name="fsdp2", description="d", status="ok", analysis=b, requested_peak_bytes=None),
               dict(name="x", description="d", status="OOM", error="OOM: boom")]
    md = pb.report_markdown(dict(num_params=1e6, layers=2, world=8, fake=True, command="c"), results)
    assert "| held: unknown | 0.000 | 0.000 | -0.000 |" in md
    assert "| **peak** |" in md and "phase at peak | backward | backward" in md
    assert "| step: autograd | 0.000 | 0.000 | +0.000 |" in md
    assert "**OOM**" in md and "ours - fsdp2" in md


def test_analysis_needs_no_torch():
    assert "torch" not in vars(pb) and "bench_gpt" not in vars(pb)


def test_three_systems_against_the_last():
    end = snapshot(step_trace(), [HELD_PARAM, HELD_ADAM])
    a = pb.analyze_step(end, start_blocks=[HELD_PARAM, HELD_ADAM, HELD_FREED_IN_FWD])
    small = pb.analyze_step(snapshot(marker("forward") + [alloc(5, 100, [])], []), start_blocks=[])
    results = [dict(name=n, status="ok", analysis=x) for n, x in (("a", a), ("b", a), ("ref", small))]
    md = pb.comparison_markdown(results)
    assert "| | a | b | ref | a - ref | b - ref |" in md
    assert "- a holds more than ref at its peak in: step: autograd +0.000; " in md


def test_full_name_selects_one_system():
    import types

    names = ["ours-x-sf", "ours-x-sf-rootsplit", "ours-x-tp", "fsdp2-zero3", "fsdp2-no_reshard"]
    systems = [types.SimpleNamespace(name=n) for n in names]

    def prefix_select(token, offload_fractions=()):
        return [s for s in systems if s.name == token or s.name.startswith(token + "-")]

    B = types.SimpleNamespace(all_systems=lambda offload_fractions=(): systems, select_systems=prefix_select)
    assert [s.name for s in pb.select_systems(B, "fsdp2-zero3, ours-x-sf")] == ["ours-x-sf", "fsdp2-zero3"]
    assert [s.name for s in pb.select_systems(B, "ours-x,fsdp2")] == names
