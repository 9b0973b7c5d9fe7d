"""torch's flat-tensor all-gather and reduce-scatter under one name on every torch release.

torch 2.13 renamed them (``all_gather_into_tensor`` -> ``all_gather_single``, ``reduce_scatter_tensor``
-> ``reduce_scatter_single``) and the old names print a FutureWarning at every call; older torch (2.11
on the GPU hosts) has only the old names. Every flat all-gather and reduce-scatter of the package goes
through these two: the Communicator's (collectives.py) and the ledger's own check (ledger.py), which
is why they live apart from both.
"""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["all_gather_single", "reduce_scatter_single"]

all_gather_single = dist.all_gather_single if hasattr(dist, "all_gather_single") else dist.all_gather_into_tensor
reduce_scatter_single = (dist.reduce_scatter_single if hasattr(dist, "reduce_scatter_single")
                         else dist.reduce_scatter_tensor)
