"""Runnable examples; not part of the installed package (``setup.py`` installs ``megatron_fsdp_v2`` only).

* ``megatron_demo.py`` (``make demo``): a tiny Megatron GPT trained with every sharding strategy on
  CPU ranks; needs a checkout (it uses ``testing/cpu_compat.py``).
* ``pretrain_gpt.py``: Megatron-LM's training loop with our wrapper as the data-parallel class
  (GPUs): ``torchrun --nproc-per-node 8 examples/pretrain_gpt.py <megatron args>``.

This file makes ``examples`` importable from the repository root, as the tests do
(``from examples import pretrain_gpt``).
"""
