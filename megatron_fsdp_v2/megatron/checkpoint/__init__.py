"""The Megatron adapter's checkpoints. Megatron's ``dist_checkpointing`` (``--ckpt-format torch_dist``)
for the wrapper and the optimizer under Megatron's own keys (``dist_checkpoint.py``), with Megatron
DDP + DistributedOptimizer's optimizer layouts (``distopt_format.py``) and the values a load returns
turned back into ours (``loaded_values.py``); Megatron-FSDP's ``fsdp_dtensor`` format
(``fsdp_dtensor_format.py``); the core's DCP checkpoints for an adapter model (``dcp_checkpoint.py``);
and which format a checkpoint directory holds (``checkpoint_format.py``). Not to be confused with
the core's ``megatron_fsdp_v2/checkpoint/``, which these build on. Importing this package imports
no megatron.
"""
