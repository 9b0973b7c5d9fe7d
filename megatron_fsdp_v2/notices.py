"""Notices that need no action, summarized: what our command-line tools (the Megatron launcher,
``python -m megatron_fsdp_v2.plan``, ``make demo``) show of what Megatron-Core and torch print while
they import and start.

Megatron-Core 0.19.2 warns at import that Transformer Engine and Apex are missing (five texts, each
from several modules and on every rank), logs deprecations of the APIs Megatron-LM's own example
calls (``GPTModel``, model-provider functions), and on CPU torch adds that it finds no CUDA. Shown
as they come, they bury a table under fourteen lines up to 268 columns wide. ``summarize_notices()``
swallows each such notice and prints, the first time one of a kind arrives, one line for the kind
(rank 0 only; at most 100 columns) that names it and the flag that shows them all. Everything
else passes untouched: other warnings, every log record above WARNING, and so every error.

Only text is matched (a message pattern, a logger name): nothing here imports Megatron, so a tool
installs it before Megatron's modules import. Idempotent; ``stop_summarizing()`` undoes it, and
``notices_summarized()`` holds it for a ``with`` block.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import sys
import warnings
from typing import Callable, Dict, Optional, Tuple

__all__ = ["LINE_WIDTH", "NOTICE_KINDS", "NoticeKind", "notices_summarized", "stop_summarizing", "summarize_notices"]

LINE_WIDTH = 100        # the most columns a summary line takes


@dataclasses.dataclass(frozen=True)
class NoticeKind:
    """Notices that say the same thing to a user of this package: their patterns, the loggers that
    log them (besides ``warnings.warn``) and the one line that stands for them all."""

    name: str
    summary: str
    patterns: Tuple[str, ...]
    loggers: Tuple[str, ...] = ()


NOTICE_KINDS: Tuple[NoticeKind, ...] = (
    NoticeKind("optional packages", "no Transformer Engine or Apex: Megatron uses its torch fallbacks",
               (r"Transformer Engine and Apex are not installed", r"^Apex is not installed",
                r"^Only transformer-engine>=[\d.]+ supports MoE experts")),
    NoticeKind("megatron's calls", "Megatron deprecations and its own calls' torch notices (GPTModel, DCP)",
               (r"^GPTModel IS DEPRECATED", r"It is recommended to use a ModelConfig", r"^MimoModelConfig is "
                r"experimental", r"^full scope is deprecated", r"^MCore's async save is deprecated",
                r"`torch\.distributed\.all_gather_into_tensor` is deprecated",
                r"^torch\.distributed is disabled, unavailable or uninitialized, assuming the intent is to load in a "
                r"single process", r"^The argument order of load has been changed"),
               ("megatron.core.models.gpt.gpt_model", "megatron.core.dist_checkpointing.strategies.torch")),
    NoticeKind("no gpu", "no GPU: torch and Megatron notices on CUDA, pinned memory, the CUDA RNG",
               (r"^No CUDA runtime is found", r"'pin_memory' argument is set as true but no accelerator",
                r"^CPU RNG state changed within GPU RNG context"),
               ("torch.utils.cpp_extension", "megatron.core.tensor_parallel.random")),
    NoticeKind("start-up", "Megatron start-up info (rerun state machine mode, mock data's cache)",
               (r"^RerunStateMachine initialized in mode", r"^Unable to save MockGPTDataset indexes"),
               ("megatron.core.rerun_state_machine", "megatron.core.datasets.gpt_dataset")),
)


class _Summary(logging.Filter):
    """The installed state: which kinds were summarized, what was replaced (to undo it)."""

    def __init__(self, verbose_hint: str, stream, show_lines: bool) -> None:
        super().__init__()
        self.verbose_hint = verbose_hint
        self.stream = stream
        self.show_lines = show_lines
        self.counts: Dict[str, int] = {}
        self.previous_showwarning: Optional[Callable] = None
        self.compiled = [(kind, re.compile("|".join(f"(?:{p})" for p in kind.patterns))) for kind in NOTICE_KINDS]

    def kind_of(self, text: str) -> Optional[NoticeKind]:
        stripped = text.strip()
        return next((kind for kind, pattern in self.compiled if pattern.search(stripped)), None)

    def swallow(self, text: str) -> bool:
        """Count a known notice (printing its kind's line the first time); False for anything else."""
        kind = self.kind_of(text)
        if kind is None:
            return False
        if kind.name not in self.counts and self.show_lines:
            print(f"note: {kind.summary}; {self.verbose_hint} shows them"[:LINE_WIDTH], file=self.stream or sys.stderr,
                  flush=True)
        self.counts[kind.name] = self.counts.get(kind.name, 0) + 1
        return True

    def filter(self, record: logging.LogRecord) -> bool:         # logging.Filter: False drops the record
        return record.levelno > logging.WARNING or not self.swallow(record.getMessage())

    def showwarning(self, message, category, filename, lineno, file=None, line=None) -> None:
        if not self.swallow(str(message)):
            self.previous_showwarning(message, category, filename, lineno, file, line)


_INSTALLED: Optional[_Summary] = None


def summarize_notices(verbose_hint: str = "--verbose", rank: Optional[int] = None, stream=None) -> Dict[str, int]:
    """Swallow the notices of ``NOTICE_KINDS`` from here on, one line per kind the first time (on
    ``rank`` 0, default: the ``RANK`` torchrun sets, else 0; the other ranks print none).
    ``verbose_hint`` names what shows them all. Returns the live count of swallowed notices per kind."""
    global _INSTALLED
    if _INSTALLED is None:
        rank = int(os.environ.get("RANK", "0")) if rank is None else rank
        summary = _Summary(verbose_hint, stream, show_lines=rank == 0)
        summary.previous_showwarning = warnings.showwarning
        warnings.showwarning = summary.showwarning
        for name in {name for kind in NOTICE_KINDS for name in kind.loggers}:
            logging.getLogger(name).addFilter(summary)
        _INSTALLED = summary
    return _INSTALLED.counts


def stop_summarizing() -> None:
    """Undo ``summarize_notices`` (warnings.showwarning back, if nothing replaced it since; filters off)."""
    global _INSTALLED
    if _INSTALLED is None:
        return
    if warnings.showwarning == _INSTALLED.showwarning:
        warnings.showwarning = _INSTALLED.previous_showwarning
    for name in {name for kind in NOTICE_KINDS for name in kind.loggers}:
        logging.getLogger(name).removeFilter(_INSTALLED)
    _INSTALLED = None


@contextlib.contextmanager
def notices_summarized(verbose_hint: str = "--verbose"):
    """``summarize_notices`` for the ``with`` block only (a command's ``main`` called in a process
    that goes on, e.g. a test's); left as it was if something summarized them already."""
    installed_here = _INSTALLED is None
    summarize_notices(verbose_hint)
    try:
        yield
    finally:
        if installed_here:
            stop_summarizing()
