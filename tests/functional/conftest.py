"""Functional suite plumbing: skip without CUDA, one process group per rank, quiet ranks > 0.

Launch: ``torchrun --nproc-per-node=$NGPU -m pytest tests/functional`` (every rank runs the same
tests in the same order). Without ``torchrun`` and with CUDA, a world of one process is made from
defaults. Without CUDA every test here is skipped at collection (nothing is initialised), so
``make test`` on a CPU machine reports them as skipped.
"""

from __future__ import annotations

import os

# cuBLAS reads this when its first handle is created: set it before anything touches CUDA.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import pytest  # noqa: E402
import torch  # noqa: E402

from . import harness  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
RUN_COMMAND = "torchrun --nproc-per-node=$NGPU -m pytest tests/functional"
SKIP_REASON = ("functional suite needs CUDA GPUs (NCCL) and none is available; run on a GPU node: "
               f"`{RUN_COMMAND}` (see tests/functional/README.md)")


def _enabled() -> bool:
    return harness.smoke_mode() or torch.cuda.is_available()


def _ours(item) -> bool:
    return os.path.abspath(str(item.path)).startswith(HERE + os.sep)


def pytest_collection_modifyitems(config, items):
    if _enabled():
        return
    skip = pytest.mark.skip(reason=SKIP_REASON)
    for item in items:
        if _ours(item):
            item.add_marker(skip)


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    """Ranks > 0 write their pytest report to FUNCTIONAL_RESULTS_DIR/rank<r>.log; rank 0's terminal
    shows the one report (every rank asserts on the same gathered numbers)."""
    rank = harness.env_rank()
    if rank == 0 or os.environ.get("FUNCTIONAL_ALL_RANKS_OUTPUT") == "1":
        return
    reporter = config.pluginmanager.getplugin("terminalreporter")
    if reporter is None:
        return
    try:
        from _pytest.terminal import TerminalReporter

        os.makedirs(harness.results_dir(), exist_ok=True)
        log = open(os.path.join(harness.results_dir(), f"rank{rank}.log"), "w", buffering=1)
        config.pluginmanager.unregister(reporter)
        config.pluginmanager.register(TerminalReporter(config, file=log), "terminalreporter")
    except Exception:  # noqa: BLE001 - keep the default output rather than fail the run
        pass


def pytest_report_header(config):
    if not _enabled():
        return [f"functional suite: skipped (no CUDA); on a GPU node: {RUN_COMMAND}"]
    world = os.environ.get("WORLD_SIZE", "1")
    device = "cpu (FUNCTIONAL_CPU_SMOKE=1)" if harness.smoke_mode() else torch.cuda.get_device_name(0)
    return [f"functional suite: world size {world}, {device}, torch {torch.__version__}, "
            f"nccl {torch.cuda.nccl.version() if torch.cuda.is_available() else '-'}",
            f"functional suite: ours = {harness.adapter_status()[1]}",
            f"functional suite: results (measured losses, ranks > 0 logs) in {harness.results_dir()}"]


@pytest.fixture(scope="package")
def world():
    """The process group (NCCL, one GPU per rank) and Megatron's parallel state, for this package's
    tests only: torn down after its last test so other suites in the same pytest run see nothing."""
    w = harness.setup_world()
    try:
        yield w
    finally:
        try:
            path = harness.write_measured(w)
            if path:
                print(f"\nfunctional suite: measured loss curves written to {path}")
            # every rank finishes its report before any exits: torchrun stops the other ranks as
            # soon as one exits non-zero (a failed test), which would cut their logs short
            harness.barrier()
        finally:
            harness.teardown_world()
