"""Every strategy trains exactly like torch DDP (fp32, SGD with momentum and AdamW, k in {1, 3})."""

import pytest

from .dist_utils import run_distributed
from .scenarios import parity_worker


@pytest.mark.parametrize("dp_size", [1, 2, 4])
def test_every_strategy_matches_ddp(dp_size):
    reports = run_distributed(parity_worker, dp_size)
    for rank, report in enumerate(reports):
        assert len(report) == 4 * 2 * 2
        for (strategy, k, opt), (failures, moved) in report.items():
            assert not failures, f"rank {rank} {strategy} k={k} {opt}: {failures}"
            assert moved > 1e-3, f"{strategy} k={k} {opt}: weights did not change (moved {moved})"
