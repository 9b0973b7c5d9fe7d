"""Parameters whose tensor class gathers itself through FSDP2's all-gather extension protocol
(``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``, e.g. torchao's float8 weights): which
parameters use it, calling the hooks by arity, a class without its data, the refusals
(``protocol.py``); and a group of such parameters' compute weights, cast or gathered as bytes
(``weights.py``).
"""
