"""The wrap: what runs once, when ``fully_shard`` is called. The checks of its arguments, process
groups, parameters and start values (``checks.py``) and that every rank asks for the same wrap
(``rank_agreement.py``); which module instances are units and which parameters each unit's groups
hold (``units.py``), nested ``fully_shard`` calls (``nested.py``), expert parameters on their own
group (``experts.py``), a meta-device model initialized one initializer at a time
(``meta_init.py``), and the units and their parameter groups built from all that
(``build_units.py``). Nothing here runs during a training step.
"""
