import os
import tempfile

import pytest
import torch.distributed as dist


@pytest.fixture(scope="module")
def single_rank_group():
    """A 1-rank gloo group in the test process, for checks that need no second rank."""
    if dist.is_initialized():
        yield dist.group.WORLD
        return
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'store')}", rank=0, world_size=1)
        try:
            yield dist.group.WORLD
        finally:
            dist.destroy_process_group()
