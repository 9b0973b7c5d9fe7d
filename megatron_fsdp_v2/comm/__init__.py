"""Communication: every collective the core issues and its counting (``collectives.py``), each process
group's ledger of them that detects ranks issuing different collectives (``ledger.py``) and the
thread that compares the ranks' ledgers after a stall on NCCL (``watchdog.py``), our threads
(that watchdog, offload's stepping thread) joined at ``destroy_process_group`` and at interpreter
exit (``thread_shutdown.py``), and hybrid sharding's (outer, inner) groups with the average across
replicas (``replicas.py``).

This package re-exports ``collectives.py``'s public names, so ``from megatron_fsdp_v2.comm import
Communicator`` keeps working; patch or read module state on ``comm.collectives`` itself.
"""

from .collectives import (COLLECTIVES, CommStats, Communicator, PendingCollective, all_gather_single,
                          reduce_scatter_single, wait_pending)

__all__ = ["COLLECTIVES", "CommStats", "Communicator", "PendingCollective", "all_gather_single",
           "reduce_scatter_single", "wait_pending"]
