"""megatron_fsdp_v2/notices.py: the notices that need no action come as one line per kind (rank 0
only, at most 100 columns); other warnings, and log records above WARNING, pass untouched. The
commands that use it are counted where they run as the docs write them (test_doc_snippets.py)."""

from __future__ import annotations

import io
import logging
import warnings

import pytest

from megatron_fsdp_v2.notices import LINE_WIDTH, NOTICE_KINDS, stop_summarizing, summarize_notices

#: One real text of each kind (Megatron-Core 0.19.2's and torch 2.13's), and the logger it comes from.
SAMPLES = {
    "optional packages": ("Transformer Engine and Apex are not installed. Falling back to Torch optimizers.", None),
    "megatron's calls": ("GPTModel IS DEPRECATED. GPTModel is only accepting critical bug fixes",
                         "megatron.core.models.gpt.gpt_model"),
    "no gpu": ("No CUDA runtime is found, using CUDA_HOME='/usr/local'", "torch.utils.cpp_extension"),
    "start-up": ("RerunStateMachine initialized in mode RerunMode.VALIDATE_RESULTS", "megatron.core.rerun_state_machine"),
}


@pytest.fixture
def shown():
    """Python's default filters, warnings.showwarning recording what is shown; summarizing undone
    before and after."""
    stop_summarizing()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        seen = []
        warnings.showwarning = lambda message, *args, **kwargs: seen.append(str(message))
        yield seen
        stop_summarizing()


def _log(name: str, level: int, text: str) -> int:
    """How many records of ``text`` logged at ``level`` on logger ``name`` reach a handler."""
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger().addHandler(handler)
    try:
        logging.getLogger(name).log(level, text)
    finally:
        logging.getLogger().removeHandler(handler)
    return len(records)


def test_each_kind_of_notice_is_one_line_on_rank_0(shown):
    assert {kind.name for kind in NOTICE_KINDS} == set(SAMPLES)
    out = io.StringIO()
    counts = summarize_notices(rank=0, stream=out)
    for text, logger in SAMPLES.values():
        for _ in range(3):
            warnings.warn(text)
            if logger is not None:
                assert _log(logger, logging.WARNING, text) == 0
    warnings.warn("Apex is not installed. Falling back to Torch Norm")
    lines = out.getvalue().splitlines()
    assert [line.split(";")[0] for line in lines] == [f"note: {kind.summary}" for kind in NOTICE_KINDS]
    assert all(line.endswith("; --verbose shows them") and len(line) <= LINE_WIDTH for line in lines)
    assert counts == {"optional packages": 4, "megatron's calls": 6, "no gpu": 6, "start-up": 6}
    assert shown == []


def test_other_warnings_and_errors_pass(shown):
    summarize_notices(rank=0, stream=io.StringIO())
    warnings.warn("Megatron-FSDP is only compatible with --use-distributed-optimizer.")
    assert shown == ["Megatron-FSDP is only compatible with --use-distributed-optimizer."]
    text, logger = SAMPLES["start-up"]
    assert _log(logger, logging.ERROR, text) == 1            # above WARNING: never swallowed
    assert _log(logger, logging.WARNING, "the rerun state machine found a fault") == 1


def test_other_ranks_print_no_line_and_summarizing_is_undone(shown):
    out = io.StringIO()
    summarize_notices(rank=1, stream=out)
    assert summarize_notices(rank=0, stream=out) is summarize_notices()          # idempotent: the first stays
    warnings.warn(SAMPLES["optional packages"][0])
    assert out.getvalue() == "" and shown == []
    stop_summarizing()
    warnings.warn(SAMPLES["optional packages"][0])
    assert shown == [SAMPLES["optional packages"][0]]
    assert _log(SAMPLES["start-up"][1], logging.WARNING, SAMPLES["start-up"][0]) == 1


def test_make_demo_prints_at_most_100_columns(capsys):
    """``make demo``'s table, its legend, the round-trip line and a progress bar, at wide values (a
    differing round trip, every strategy's label, a 100M-parameter model, 1000 steps)."""
    import argparse

    import torch

    from examples import megatron_demo

    opts = argparse.Namespace(micro_batches=2, iters=1000, layers=128, hidden=16384, vocab=262144, seq=32768)
    state = {"w": torch.ones(3)}
    comm = {kind: {"bytes": 10 ** 11} for kind in ("all_reduce", "reduce_scatter", "all_gather")}
    rows = [dict(label=megatron_demo.REFERENCE, strategy=megatron_demo.REFERENCE, losses=[123.45678], comm=None,
                 persistent=5 * 10 ** 10, adam=5 * 10 ** 10, state=state, numel=99_999_999, step={30.0})]
    for strategy in megatron_demo.STRATEGY_NAMES:
        rows.append(dict(label=f"{strategy} ({megatron_demo.ZERO_NAMES[strategy]})", strategy=strategy,
                         losses=[123.45678], comm=comm, persistent=5 * 10 ** 10, adam=5 * 10 ** 10, numel=99_999_999,
                         state={"w": torch.full((3,), 2.0)}, step={30.0}, reloaded=("optim", {"w": torch.ones(3)}, {29.0})))
    table = megatron_demo._table(rows, opts, 8)
    assert "checkpoint round trips: 0 of 4 bitwise" in table and "DIFFERS: optim_grads_params -> optim" in table
    megatron_demo._Progress("optim_grads_params (ZeRO-3)", 1000, enabled=True).update(1000, 123.4567)
    lines = table.splitlines() + capsys.readouterr().out.splitlines() + megatron_demo._heading(opts, 128).splitlines()
    assert max(len(line) for line in lines) <= 100, max(lines, key=len)
