"""Scaffolding shared by the CPU demo (``examples/megatron_demo.py``), the tests and the benchmarks.

Not library code: ``setup.py`` installs only ``megatron_fsdp_v2`` (``find_packages(include=
["megatron_fsdp_v2", "megatron_fsdp_v2.*"])``), so this package exists only in a checkout and is
imported from the repository root (pytest's rootdir, ``python -m ...`` from the root, or a script
that puts the root on ``sys.path``). Nothing in ``megatron_fsdp_v2`` imports it
(``tests/unit/test_layering.py``).

* ``cpu_compat``: Megatron-Core 0.19.2's CUDA-only spots patched for CPU/gloo runs, the parallel-state
  helpers, and ``UNFUSED_KERNELS`` (the plain-PyTorch ``TransformerConfig`` kernel settings).
"""
