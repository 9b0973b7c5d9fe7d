"""Know before launch: per-rank memory and communication of each sharding strategy
(``plan``), and the choice ``fully_shard(sharding_strategy="auto")`` makes from it.

Files: groups.py (the groups fully_shard would build, from its own code), memory.py (bytes kept
per kind, device and host), offload.py (which groups go to the host, the copies per step),
schedule.py (one step's temporaries and collectives), phases.py (our bytes where activations
meet them, the peak with activations), optimizer_step.py (what the optimizer kernel's step allocates),
report.py (records, table),
auto.py (the choice), resolve.py (``AutoStrategy``, the budget ranks agree on), planner.py
(``plan``), __main__.py (``python -m megatron_fsdp_v2.plan``).

``megatron_fsdp_v2.plan`` is the function (the package re-exports it); import names from this
package with ``from megatron_fsdp_v2.plan import ...`` (``import megatron_fsdp_v2.plan as p`` gives
the function too).
"""

from .auto import NoPlanFitsError, choose
from .planner import plan, plan_candidates
from .report import Plan, StrategyPlan
from .resolve import AutoStrategy

__all__ = ["AutoStrategy", "NoPlanFitsError", "Plan", "StrategyPlan", "choose", "plan", "plan_candidates"]
