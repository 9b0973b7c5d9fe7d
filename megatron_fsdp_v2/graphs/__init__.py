"""A whole training step as one CUDA graph (make_graphed_step): requirements.py says what a capture
needs and refuses, watch.py what a replay cannot see change, graphed_step.py the warm-up, capture
and replay."""

from .graphed_step import GraphedStep, make_capture_safe, make_graphed_step

__all__ = ["GraphedStep", "make_capture_safe", "make_graphed_step"]
