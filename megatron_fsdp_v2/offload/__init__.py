"""CPU offload by fraction. What is asked for and which groups it puts in host memory
(``policy.py``: ``OffloadPolicy`` and the choice); the copies between the device and the host on
side streams and an offloaded group's host gradient and device compute shard (``host_link.py``);
offloaded groups stepped on a host thread during backward (``backward_steps.py``); page-locked host
buffers at their exact size (``host_memory.py``). A parameter group's own offload part is
``group/offload.py``; the threads' shutdown at ``destroy_process_group`` is ``comm/thread_shutdown.py``.
"""
