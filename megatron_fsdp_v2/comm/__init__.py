"""Communication: every collective the core issues and its counting (``collectives.py``), each process
group's ledger of them that detects ranks issuing different collectives (``ledger.py``; one per
group in the process, ``ledger_registry.py``) and the thread that compares the ranks' ledgers after
a stall on NCCL (``watchdog.py``), our threads
(that watchdog, offload's stepping thread) joined at ``destroy_process_group`` and at interpreter
exit (``thread_shutdown.py``), and hybrid sharding's (outer, inner) groups with the average across
replicas (``replicas.py``).

This package re-exports ``collectives.py``'s public names and ``flat_names.py``'s two (torch's flat
all-gather and reduce-scatter on every release), so ``from megatron_fsdp_v2.comm import Communicator``
keeps working; patch or read module state on ``comm.collectives`` itself.
"""

from .collectives import COLLECTIVES, CommStats, Communicator, PendingCollective, wait_pending
from .flat_names import all_gather_single, reduce_scatter_single

__all__ = ["COLLECTIVES", "CommStats", "Communicator", "PendingCollective", "all_gather_single",
           "reduce_scatter_single", "wait_pending"]
