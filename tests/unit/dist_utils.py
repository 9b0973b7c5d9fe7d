"""``run_distributed`` for the unit tests: the persistent gloo worker pool of ``tests/dist_pool.py``.

``run_distributed(fn, world_size, *args, timeout=300.0, fresh=False)`` runs ``fn(rank, world_size,
*args)`` (a module-level function) on every rank of a gloo group and returns the per-rank results;
a worker's exception is re-raised in the parent naming the rank, with its traceback. See
``tests/dist_pool.py`` for what is reset between cases and when to pass ``fresh=True``.
"""

from tests.dist_pool import (DistributedTimeoutError, DistributedWorkerError, free_port,  # noqa: F401
                             run_distributed)
