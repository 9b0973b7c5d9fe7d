"""DTensor semantics for our parameters, installed once by ``row_sharded.py``: op handlers for
max-like reductions and infinity norms where a rank holds no rows (``op_handlers.py``), the checks
of in-place writes indexed along a sharded dimension (``indexed_writes.py``), and ``torch.save`` of
a DTensor whose local piece is a view at a non-zero offset (``pickling.py``).
"""
