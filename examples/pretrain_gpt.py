"""GPT pretraining with Megatron-LM's training loop and megatron_fsdp_v2 as the data-parallel wrapper.

Usage (GPUs, torchrun; mock data, ``NullTokenizer``), from the repository root with
``megatron_fsdp_v2`` installed (``pip install -e ".[megatron]"``)::

    torchrun --nproc-per-node 8 examples/pretrain_gpt.py \\
        --data-parallel-sharding-strategy optim_grads_params \\
        --num-layers 4 --hidden-size 512 --num-attention-heads 8 --seq-length 1024 \\
        --max-position-embeddings 1024 --micro-batch-size 2 --global-batch-size 64 \\
        --train-iters 100 --lr 3e-4 --bf16 --tokenizer-type NullTokenizer --vocab-size 32000 \\
        --transformer-impl local --no-persist-layer-norm --no-masked-softmax-fusion --mock-data

Every argument is Megatron-LM's (``megatron.training.arguments``), parsed and validated by
Megatron. ``--data-parallel-sharding-strategy {no_shard,optim,optim_grads,optim_grads_params,auto}``
selects *our* strategy (Megatron's parser default is ``optim_grads_params``; ``auto``: see
``parse_args``, with the launcher's ``--activation-reserve-gib G``). Notices that need no action
(Transformer Engine / Apex missing, deprecations of the APIs this example calls, CPU stand-ins) are
summarized in one line per kind on rank 0 (``megatron_fsdp_v2.notices``); Megatron's other warnings
show once per process each (``quiet_repeated_warnings``); the launcher's ``--verbose`` keeps
Megatron's default.

A Megatron-FSDP command line runs unchanged: ``--use-megatron-fsdp`` selects this package (the
Megatron-FSDP being swapped in). Megatron's validation runs with it, as in Megatron-LM: it forces
``--use-distributed-optimizer`` (with every strategy: the strategy decides what is sharded, ``no_shard``
keeps replicated optimizer state), allows ``--optimizer adam`` / ``sgd`` only and demands ``--ckpt-format
fsdp_dtensor``, which ``--save`` writes and ``--load`` reads in Megatron-FSDP's layout (left out, the
launcher says so once, on rank 0, and every rank exits with status 2, where Megatron-LM's assertion
would print a traceback per rank)::

    torchrun --nproc-per-node 8 examples/pretrain_gpt.py --use-megatron-fsdp --use-distributed-optimizer \\
        --ckpt-format fsdp_dtensor --data-parallel-sharding-strategy optim_grads_params ...   # the flags above

Megatron-FSDP's other flags are honoured, refused or warned about as docs/megatron_settings.md says. ``--use-torch-fsdp2``
is refused.

An example, not library code: it lives outside the installed package, and its pieces
(``parse_args``, ``use_fully_sharded_data_parallel``, ``model_provider``, ``forward_step``) are
meant to be copied into a training script. It uses only the public API of
``megatron_fsdp_v2.megatron`` (``FullyShardedDataParallel``, ``get_optimizer``,
``check_optimizer_config``).

How our class gets in (the hook is installed only inside ``main()``, by
``use_fully_sharded_data_parallel()``, and undone afterwards):

* ``megatron.training.training.wrap_model_chunks_with_ddp`` -- the function ``get_model`` calls to
  wrap each model chunk -- is replaced by a function that calls the original with
  ``DP=FullyShardedDataParallel`` instead of Megatron's ``DistributedDataParallel``. Our class
  derives from Megatron's DDP, so ``train()``'s ``isinstance(model[0], (megatron_FSDP, DDP))``
  gates (``no_sync`` / grad-sync hooks with ``--overlap-grad-reduce``) and ``unwrap_model`` work.
* ``megatron.training.training.get_megatron_optimizer`` is replaced by
  ``megatron_fsdp_v2.megatron.get_optimizer`` (weight decay by original parameter shapes, correct
  global grad norm over shards; see ``megatron_fsdp_v2/megatron/optimizer.py``).

Defaults: ``--tokenizer-type NullTokenizer`` (give ``--vocab-size``). The launcher also sets
``gradient_accumulation_fusion=False`` (the fused wgrad kernels write into
``param.main_grad``, which our wrapper does not provide).

Checkpoints: ``--save DIR --save-interval N`` / ``--load DIR`` with ``--ckpt-format torch_dist``
(Megatron-LM's default) or ``fsdp_dtensor`` (Megatron-FSDP's; the other formats are rejected). Each
rank writes only its shards (``megatron_fsdp_v2/megatron/checkpoint/dist_checkpoint.py``); a checkpoint loads at
another data-parallel size and with another ``--data-parallel-sharding-strategy``, model and
optimizer state included. With ``torch_dist``, ``--save`` writes the optimizer in Megatron DDP +
DistributedOptimizer's layout (``fully_reshardable``; ``dp_reshardable`` when Megatron-LM asks for it:
``--use-distributed-optimizer`` without ``--dist-ckpt-optim-fully-reshardable``), so Megatron-LM with
``--use-distributed-optimizer`` resumes from it; ``--load`` of such a checkpoint written by
Megatron-LM resumes with its optimizer state (``load_checkpoint`` is wrapped to read which layout the
directory holds first: ``read_optimizer_layout``). With ``fsdp_dtensor``, ``--save`` writes
Megatron-FSDP's layout (``save_megatron_fsdp_checkpoint``: dense GPT layers without ``--swiglu``,
tensor- and pipeline-parallel size 1) and ``--load`` reads it; ``--auto-detect-ckpt-format`` reads
either format (``checkpoint_format_to_load``; ``load_megatron_fsdp_checkpoint``).
docs/checkpointing.md has the recipes, both directions.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import logging
import os
import re
import sys
import warnings
from typing import List, Optional

import torch

from megatron_fsdp_v2 import STRATEGY_NAMES, AutoStrategy
from megatron_fsdp_v2.notices import summarize_notices

if __name__ == "__main__" and "--verbose" not in sys.argv:
    summarize_notices()     # before Megatron's modules import below: their import-time notices too

from megatron_fsdp_v2.megatron import (FullyShardedDataParallel, check_optimizer_config,  # noqa: E402
                                       get_optimizer, read_optimizer_layout)
from megatron_fsdp_v2.megatron.checkpoint.checkpoint_format import (  # noqa: E402
    CORE_DCP, FSDP_DTENSOR, TORCH_DIST, detect_checkpoint_format)
from megatron_fsdp_v2.megatron.wrap_settings import megatron_adam_kernel  # noqa: E402

logger = logging.getLogger(__name__)

#: The class ``get_model`` builds for every model chunk under ``use_fully_sharded_data_parallel``.
DATA_PARALLEL_CLASS = FullyShardedDataParallel

#: Applied by Megatron's ``validate_args`` to arguments left unset on the command line.
LAUNCHER_DEFAULTS = {"tokenizer_type": "NullTokenizer"}

class LauncherArgumentError(ValueError):
    """A command line this launcher refuses (its own checks, before Megatron's validation). ``main``
    prints it once, on rank 0, and every rank exits with status 2; Megatron-LM's own errors pass
    through untouched, a traceback per rank as Megatron-LM gives them."""


_FORBIDDEN_FLAGS = {
    "use_torch_fsdp2": "--use-torch-fsdp2 selects torch FSDP2; this launcher uses megatron_fsdp_v2",
}


def check_launcher_args(args: argparse.Namespace) -> None:
    """Reject flags that would pick another wrapper, and the optimizer flags settings.py refuses;
    applied before Megatron's validation."""
    problems = [text for flag, text in _FORBIDDEN_FLAGS.items() if getattr(args, flag, False)]
    strategy = getattr(args, "data_parallel_sharding_strategy", None)
    if strategy not in STRATEGY_NAMES + ("auto",):
        problems.append(f"--data-parallel-sharding-strategy must be one of {list(STRATEGY_NAMES) + ['auto']}, "
                        f"got {strategy!r}")
    ckpt_format = getattr(args, "ckpt_format", "torch_dist")
    if (getattr(args, "save", None) or getattr(args, "load", None)) and ckpt_format != "torch_dist":
        problems.append(f"--ckpt-format must be torch_dist or fsdp_dtensor with --save / --load (sharded, "
                        f"reshardable across data-parallel sizes and strategies; torch and torch_dcp do not hold "
                        f"the sharded optimizer state of this wrapper), got {ckpt_format!r}")
    if getattr(args, "use_megatron_fsdp", False) and not getattr(args, "ckpt_format_fsdp_dtensor", False):
        problems.append(f"--use-megatron-fsdp needs --ckpt-format fsdp_dtensor (Megatron-LM's validation demands it "
                        f"with Megatron-FSDP), got --ckpt-format {ckpt_format}; add --ckpt-format fsdp_dtensor")
    if getattr(args, "ckpt_format_fsdp_dtensor", False) and getattr(args, "save", None):
        problems += _fsdp_dtensor_save_problems(args)
    problems += _async_save_problems(args)
    if getattr(args, "data_path", None) or getattr(args, "train_data_path", None):
        problems.append("this launcher trains on mock data only; drop --data-path / --train-data-path")
    if problems:
        raise LauncherArgumentError("examples/pretrain_gpt.py: " + "; ".join(problems) + ".")
    # The optimizer flags (named as OptimizerConfig's fields), before Megatron's validation asserts
    # on some of them without naming ours: e.g. --optimizer-cpu-offload is refused by its name.
    try:
        check_optimizer_config(vars(args), strategy, where="examples/pretrain_gpt.py")
    except ValueError as error:
        raise LauncherArgumentError(str(error)) from error


def _async_save_problems(args: argparse.Namespace) -> List[str]:
    """``--async-save --use-persistent-ckpt-worker`` saves through Megatron-LM's queue; its default
    strategy, ``nvrx``, is nvidia-resiliency-ext's, which would fail at the first save, after training."""
    asked = getattr(args, "async_save", False) and getattr(args, "use_persistent_ckpt_worker", False)
    if not asked or getattr(args, "async_strategy", "nvrx") != "nvrx":
        return []
    if importlib.util.find_spec("nvidia_resiliency_ext") is not None:
        return []
    return ["--async-save with --async-strategy nvrx (Megatron-LM's default) needs nvidia-resiliency-ext, which is "
            "not installed; pass --async-strategy mcore (megatron-core's own queue) or install it"]


def _fsdp_dtensor_save_problems(args: argparse.Namespace) -> List[str]:
    """What Megatron-FSDP's fsdp_dtensor layout cannot hold (megatron/checkpoint/fsdp_dtensor_format.py): Megatron-FSDP
    splits --swiglu's linear_fc1 and renumbers experts, and its keys carry stage-local layer numbers."""
    found = [flag for flag, on in (
        ("--swiglu", getattr(args, "swiglu", False)), ("--num-experts", getattr(args, "num_experts", None)),
        ("--tensor-model-parallel-size > 1", (getattr(args, "tensor_model_parallel_size", 1) or 1) > 1),
        ("--pipeline-model-parallel-size > 1", (getattr(args, "pipeline_model_parallel_size", 1) or 1) > 1)) if on]
    if not found:
        return []
    return [f"--ckpt-format fsdp_dtensor --save writes dense GPT layers without --swiglu at tensor- and pipeline-"
            f"parallel size 1, got {', '.join(found)}; save with --ckpt-format torch_dist (Megatron DDP's layout, "
            f"reshardable at every parallel size)"]


@contextlib.contextmanager
def _argv(argv: Optional[List[str]]):
    if argv is None:
        yield
        return
    saved = sys.argv
    sys.argv = [saved[0] if saved else "pretrain_gpt", *argv]
    try:
        yield
    finally:
        sys.argv = saved


#: What Megatron's parser sees in place of ``auto`` (its ``choices`` lack it); put back after parsing.
_AUTO_PLACEHOLDER = "optim_grads_params"
_STRATEGY_FLAG = "--data-parallel-sharding-strategy"
_RESERVE_FLAG = "--activation-reserve-gib"


def take_launcher_flags(argv: List[str]) -> tuple:
    """``(argv for Megatron, auto?, activation reserve in bytes)``: ``--data-parallel-sharding-strategy
    auto`` (Megatron's parser has fixed choices, so it sees a placeholder) and the launcher's own
    ``--activation-reserve-gib G`` (what ``auto`` leaves for activations; default 0), removed."""
    out, auto, reserve, i = [], False, 0, 0
    while i < len(argv):
        token = argv[i]
        flag, eq, value = token.partition("=")
        if flag in (_STRATEGY_FLAG, _RESERVE_FLAG) and not eq:
            value, i = (argv[i + 1] if i + 1 < len(argv) else ""), i + 1
        if flag == _STRATEGY_FLAG and value == "auto":
            auto = True
            out += [_STRATEGY_FLAG, _AUTO_PLACEHOLDER]
        elif flag == _RESERVE_FLAG:
            try:
                reserve = int(float(value) * (1 << 30))
            except ValueError:
                raise LauncherArgumentError(f"examples/pretrain_gpt.py: {_RESERVE_FLAG} must be a number of GiB, "
                                            f"got {value!r}.") from None
            if reserve < 0:
                raise LauncherArgumentError(f"examples/pretrain_gpt.py: {_RESERVE_FLAG} must be >= 0, got {value!r}.")
        else:
            out += [token] if flag not in (_STRATEGY_FLAG,) or eq else [token, value]
        i += 1
    return out, auto, reserve


def take_fsdp_dtensor_format(argv: List[str]) -> tuple:
    """``(argv for Megatron, fsdp_dtensor asked?)``: ``--ckpt-format fsdp_dtensor`` becomes
    ``torch_dist`` for Megatron's parser (its validation demands ``--use-megatron-fsdp`` with
    fsdp_dtensor; with ``--use-megatron-fsdp`` it is put back for the validation, which demands it);
    the launcher's ``load_checkpoint`` then reads the directory with ``load_fsdp_dtensor_training_state``
    and its ``save_checkpoint`` writes it with ``save_megatron_fsdp_checkpoint``."""
    out, asked, i = [], False, 0
    while i < len(argv):
        flag, eq, value = argv[i].partition("=")
        if flag == "--ckpt-format" and not eq and i + 1 < len(argv):
            value, i = argv[i + 1], i + 1
        if flag == "--ckpt-format" and value == "fsdp_dtensor":
            asked, out = True, out + ["--ckpt-format", "torch_dist"]
        else:
            out += [argv[i]] if flag != "--ckpt-format" or eq else ["--ckpt-format", value]
        i += 1
    return out, asked


_VERBOSE_FLAG = "--verbose"
#: Where Megatron's warnings come from (the issuing file's path), which ``quiet_repeated_warnings`` shows once each.
_MEGATRON_FILES = re.compile(r"[/\\]megatron[/\\](core|training)[/\\]")
#: Megatron's loggers whose warnings repeat: per model built ("GPTModel IS DEPRECATED"), per RNG fork
#: ("CPU RNG state changed within GPU RNG context"), per dataset split (mock data's "Unable to save").
REPEATING_MEGATRON_LOGGERS = ("megatron.core.models.gpt.gpt_model", "megatron.core.tensor_parallel.random",
                              "megatron.core.datasets.gpt_dataset", "megatron.core.dist_checkpointing.strategies.torch")


def take_verbose_flag(argv: List[str]) -> tuple:
    """``(argv for Megatron, verbose?)``: the launcher's ``--verbose`` removed (Megatron's parser has
    no such flag): keep every warning Megatron repeats instead of each once."""
    for token in argv:
        if token.startswith(_VERBOSE_FLAG + "="):
            raise LauncherArgumentError(f"examples/pretrain_gpt.py: {_VERBOSE_FLAG} takes no value, got {token!r}; "
                             f"allowed: {_VERBOSE_FLAG} alone.")
    return [t for t in argv if t != _VERBOSE_FLAG], _VERBOSE_FLAG in argv


class OncePerMessage(logging.Filter):
    """Lets each message through once per process: Megatron logs some per model chunk or per call."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message in self.seen:
            return False
        self.seen.add(message)
        return True


def quiet_repeated_warnings() -> None:
    """Each of Megatron's warnings once per process. Python's default shows a message once per line
    that issues it (``"once"`` filters: once per module), and Megatron issues the same text from
    several modules ("Apex is not installed. Falling back to Torch Norm") or logs it again per model
    built; other packages' warnings and the warning filters are left as they are. Idempotent."""
    show = warnings.showwarning
    if not getattr(show, "once_per_megatron_message", False):
        shown = set()

        def show_once(message, category, filename, lineno, file=None, line=None):
            key = (str(message), category)
            if _MEGATRON_FILES.search(filename or ""):
                if key in shown:
                    return
                shown.add(key)
            show(message, category, filename, lineno, file, line)

        show_once.once_per_megatron_message = True
        warnings.showwarning = show_once
    for name in REPEATING_MEGATRON_LOGGERS:
        megatron_logger = logging.getLogger(name)
        if not any(isinstance(f, OncePerMessage) for f in megatron_logger.filters):
            megatron_logger.addFilter(OncePerMessage())


def set_up_warnings(argv: List[str]) -> bool:
    """``summarize_notices()`` (notices that need no action: one line per kind, rank 0) and
    ``quiet_repeated_warnings()`` unless ``--verbose`` is among the launcher's arguments (then
    Megatron's default stays); True if they were installed."""
    verbose = take_verbose_flag(argv)[1]
    if not verbose:
        summarize_notices()
        quiet_repeated_warnings()
    return not verbose


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """Megatron-LM's argument parsing and validation (``argv`` defaults to ``sys.argv[1:]``),
    plus ``check_launcher_args``. Does not set Megatron's global variables.

    ``--data-parallel-sharding-strategy auto`` lets ``fully_shard`` choose (megatron_fsdp_v2.plan):
    the fewest bytes sent per step among the strategies whose planned memory fits the GPU minus
    ``--activation-reserve-gib`` (a launcher flag), for Megatron's optimizer and micro-batches."""
    from megatron.training import arguments

    megatron_argv, verbose = take_verbose_flag(list(sys.argv[1:] if argv is None else argv))
    megatron_argv, auto, reserve = take_launcher_flags(megatron_argv)
    megatron_argv, fsdp_dtensor = take_fsdp_dtensor_format(megatron_argv)
    with _argv(megatron_argv):
        args = arguments.parse_args()
    args.ckpt_format_fsdp_dtensor = fsdp_dtensor
    if auto:
        args.data_parallel_sharding_strategy = "auto"
    args.activation_reserve_bytes = reserve
    args.verbose = verbose
    check_launcher_args(args)
    if getattr(args, "gradient_accumulation_fusion", False):
        logger.info("megatron_fsdp_v2: setting gradient_accumulation_fusion=False (needs param.main_grad)")
    args.gradient_accumulation_fusion = False
    args.mock_data = True
    if args.use_megatron_fsdp and fsdp_dtensor:
        args.ckpt_format = FSDP_DTENSOR     # what Megatron's validation of --use-megatron-fsdp demands
    arguments.validate_args(args, dict(LAUNCHER_DEFAULTS))
    args.ckpt_format = TORCH_DIST if fsdp_dtensor else args.ckpt_format
    take_megatron_fsdp_flag(args)
    if getattr(args, "optimizer_cpu_offload", False):
        # Megatron's validation demands --use-precision-aware-optimizer with --optimizer-cpu-offload;
        # here it changes nothing (fp32 optimizer dtypes, checked by get_optimizer), and it would set
        # ddp_config.megatron_fsdp_use_decoupled_grad, which the wrapper refuses.
        args.use_precision_aware_optimizer = False
    return args


def take_megatron_fsdp_flag(args: argparse.Namespace) -> None:
    """``--use-megatron-fsdp`` names the Megatron-FSDP this package replaces. Megatron's validation
    has run with it (``use_distributed_optimizer`` forced, the optimizer and checkpoint format
    checked); past it, Megatron-LM must not take its own Megatron-FSDP paths (``get_model``'s wrapper
    class, norms over DTensor parameters, its fsdp_dtensor writer), so the flag is cleared and kept
    as ``args.megatron_fsdp_command_line``."""
    args.megatron_fsdp_command_line = bool(getattr(args, "use_megatron_fsdp", False))
    args.use_megatron_fsdp = False
    args.use_custom_fsdp = False


def data_parallel_class(args: argparse.Namespace) -> type:
    """The wrapper class the launcher uses for ``args`` (the strategy travels in ``ddp_config``)."""
    check_launcher_args(args)
    return DATA_PARALLEL_CLASS


def auto_strategy_from_args(args: argparse.Namespace) -> AutoStrategy:
    """What ``auto`` plans for: Megatron's optimizer (``adam`` keeps two states; ``sgd`` one with
    ``--sgd-momentum``) and its kernel, its micro-batches per step and ``--activation-reserve-gib``."""
    optimizer = {"adam": "adam", "sgd": "sgd_momentum" if getattr(args, "sgd_momentum", 0) else "sgd"}.get(args.optimizer)
    if optimizer is None:
        raise ValueError(f"--data-parallel-sharding-strategy auto plans the adam and sgd optimizers, got --optimizer "
                         f"{args.optimizer!r}; pick a strategy.")
    return AutoStrategy(activation_reserve_bytes=getattr(args, "activation_reserve_bytes", 0),
                        optimizer=optimizer, optimizer_kernel=megatron_adam_kernel(),
                        micro_batches=max(1, args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)))


@contextlib.contextmanager
def use_fully_sharded_data_parallel(args: Optional[argparse.Namespace] = None):
    """Make ``megatron.training.training`` wrap model chunks with ``FullyShardedDataParallel`` and
    build optimizers with ``get_optimizer`` (module attributes patched, restored on exit).
    ``args``: the parsed arguments ``auto`` plans from (default: Megatron's global args)."""
    from megatron.training import checkpointing, training

    from megatron_fsdp_v2.megatron.checkpoint.async_request import copy_host_tensors_at_preload

    original_wrap = training.wrap_model_chunks_with_ddp
    original_get_optimizer = training.get_megatron_optimizer

    @functools.wraps(original_wrap)
    def wrap_model_chunks(model_chunks, config, ddp_config, *, DP=None, pg_collection=None, **kwargs):
        if DP is not None and DP is not training.DDP and DP is not DATA_PARALLEL_CLASS:
            raise ValueError(f"megatron_fsdp_v2 launcher: get_model asked for {getattr(DP, '__name__', DP)}; "
                             "drop --use-torch-fsdp2, and parse the arguments with examples/pretrain_gpt.parse_args "
                             "(it takes --use-megatron-fsdp as selecting megatron_fsdp_v2).")
        wrapper = DATA_PARALLEL_CLASS
        if ddp_config.data_parallel_sharding_strategy == "auto":
            from megatron.training import get_args

            wrapper = functools.partial(DATA_PARALLEL_CLASS, auto_strategy=auto_strategy_from_args(args or get_args()))
        return original_wrap(model_chunks, config, ddp_config, DP=wrapper, pg_collection=pg_collection, **kwargs)

    # --init-model-with-meta-device: get_model would give the meta chunks uninitialized storage
    # (to_empty) unless Megatron-FSDP or FSDP2 wraps them; ours initializes and shards them itself.
    original_to_empty = training.to_empty_if_meta_device

    def keep_on_meta(module, *, device, recurse=True):
        return module

    original_load = training.load_checkpoint

    @functools.wraps(original_load)
    def load_checkpoint(ddp_model, optimizer, *args, **kwargs):
        directory = latest_checkpoint_directory()
        if directory is not None and checkpoint_format_to_load(directory) == FSDP_DTENSOR:
            return load_megatron_fsdp_checkpoint(directory, ddp_model, optimizer, *args, **kwargs)
        if optimizer is not None and directory is not None:
            read_optimizer_layout(optimizer, directory)     # ours, or Megatron DDP's (either sharding type)
        return original_load(ddp_model, optimizer, *args, **kwargs)

    original_save = training.save_checkpoint

    @functools.wraps(original_save)
    def save_checkpoint(*args, **kwargs):
        from megatron.training.global_vars import get_args

        if getattr(get_args(), "ckpt_format_fsdp_dtensor", False):
            return save_megatron_fsdp_checkpoint(*args, **kwargs)
        return original_save(*args, **kwargs)

    # --async-save --ckpt-format torch_dist: Megatron-LM's request, its preload copying host tensors
    # too ([Note: our checkpoints in Megatron's async queue])
    original_schedule = checkpointing.schedule_async_save

    def schedule_async_save(request):
        return original_schedule(copy_host_tensors_at_preload(request))

    training.wrap_model_chunks_with_ddp = wrap_model_chunks
    training.get_megatron_optimizer = get_optimizer
    training.to_empty_if_meta_device = keep_on_meta
    training.load_checkpoint = load_checkpoint
    training.save_checkpoint = save_checkpoint
    checkpointing.schedule_async_save = schedule_async_save
    with _prebuilt_dataset_helpers():
        try:
            yield
        finally:
            training.wrap_model_chunks_with_ddp = original_wrap
            training.get_megatron_optimizer = original_get_optimizer
            training.to_empty_if_meta_device = original_to_empty
            training.load_checkpoint = original_load
            training.save_checkpoint = original_save
            checkpointing.schedule_async_save = original_schedule


def latest_checkpoint_directory() -> Optional[str]:
    """The ``torch_dist`` directory Megatron-LM's ``load_checkpoint`` will read for ``--load``
    (its tracker file's iteration, or ``--ckpt-step``), or ``None`` when there is none (then
    Megatron-LM's own rules apply: start from scratch, or its error)."""
    from megatron.training import checkpointing
    from megatron.training.global_vars import get_args

    args = get_args()
    if not args.load or not checkpointing.checkpoint_exists(args.load):
        return None
    iteration, release = checkpointing.read_metadata(checkpointing.get_checkpoint_tracker_filename(args.load))
    if getattr(args, "ckpt_step", None) is not None:
        iteration, release = args.ckpt_step, False
    directory = checkpointing.get_checkpoint_name(args.load, iteration, release, return_base_dir=True)
    return directory if os.path.isfile(os.path.join(directory, ".metadata")) else None


def checkpoint_format_to_load(directory: str) -> str:
    """The format ``--load`` reads: the one found in ``directory`` with ``--auto-detect-ckpt-format``,
    else the one asked for (``--ckpt-format torch_dist`` / ``fsdp_dtensor``), which must be the one found."""
    from megatron.training.global_vars import get_args

    args = get_args()
    asked = FSDP_DTENSOR if getattr(args, "ckpt_format_fsdp_dtensor", False) else TORCH_DIST
    found = detect_checkpoint_format(directory)
    if found == CORE_DCP or (found != asked and not getattr(args, "auto_detect_ckpt_format", False)):
        raise ValueError(f"examples/pretrain_gpt.py: --load {directory!r} holds a {found} checkpoint, while "
                         f"--ckpt-format {asked} was given; pass --auto-detect-ckpt-format (torch_dist and "
                         f"fsdp_dtensor are read)" + (", or load it with megatron_fsdp_v2.megatron.load_checkpoint"
                                                     if found == CORE_DCP else "") + ".")
    return found


def load_megatron_fsdp_checkpoint(directory: str, ddp_model, optimizer, opt_param_scheduler=None, *args, **kwargs):
    """``load_checkpoint`` for a Megatron-FSDP fsdp_dtensor directory: model, optimizer (unless
    ``--no-load-optim`` / ``--finetune``) and scheduler; returns Megatron-LM's ``(iteration, flops)``.
    The checkpoint's pickled ``args`` are not read, so the consumed samples are counted from the
    iteration at a constant ``--global-batch-size``."""
    from megatron.training.global_vars import get_args

    from megatron_fsdp_v2.megatron.checkpoint.fsdp_dtensor_format import load_fsdp_dtensor_training_state

    margs = get_args()
    fresh = margs.finetune or margs.no_load_optim
    iteration, flops = load_fsdp_dtensor_training_state(directory, ddp_model[0], None if fresh else optimizer,
                                                        None if fresh else opt_param_scheduler)
    if margs.finetune:
        return 0, 0
    margs.consumed_train_samples = iteration * margs.global_batch_size
    return iteration, flops


def save_megatron_fsdp_checkpoint(iteration: int, model, optimizer, opt_param_scheduler,
                                  num_floating_point_operations_so_far=0, *args, **kwargs) -> None:
    """``save_checkpoint`` for ``--ckpt-format fsdp_dtensor``: Megatron-FSDP's layout
    (``save_fsdp_dtensor_checkpoint``) in Megatron-LM's directory for ``iteration`` under ``--save``,
    with the scheduler, the floating-point operation count and (unless ``--no-save-rng``) the RNG
    states as Megatron-LM stores them for fsdp_dtensor; then the tracker file, so ``--load`` (ours,
    or Megatron-LM's with ``--use-megatron-fsdp``) finds it. With ``--async-save`` the same through
    Megatron-LM's queue (``fsdp_dtensor_async_request``): the tracker is written by its finalize."""
    from megatron.core import parallel_state as ps
    from megatron.training import checkpointing
    from megatron.training.global_vars import get_args

    from megatron_fsdp_v2.megatron.checkpoint.async_request import fsdp_dtensor_async_request
    from megatron_fsdp_v2.megatron.checkpoint.fsdp_dtensor_format import save_fsdp_dtensor_checkpoint

    margs = get_args()
    directory = checkpointing.get_checkpoint_name(margs.save, iteration, release=False, return_base_dir=True)
    extra = {"num_floating_point_operations_so_far": num_floating_point_operations_so_far}
    if opt_param_scheduler is not None and not margs.no_save_optim:
        extra["opt_param_scheduler"] = opt_param_scheduler.state_dict()
    if not margs.no_save_rng:
        extra["rng_state"] = checkpointing.get_rng_state(FSDP_DTENSOR, ps.get_tensor_model_parallel_group(),
                                                         ps.get_pipeline_model_parallel_group())
    optimizer = None if margs.no_save_optim else optimizer
    tracker = functools.partial(_write_tracker, checkpointing.get_checkpoint_tracker_filename(margs.save), iteration)
    if margs.async_save:     # Megatron-LM's queue ([Note: our checkpoints in Megatron's async queue])
        from megatron.training.async_utils import schedule_async_save

        request = fsdp_dtensor_async_request(directory, model[0], optimizer, iteration, margs, extra=extra,
                                             async_strategy=margs.async_strategy,
                                             thread_count=margs.dist_ckpt_workers)
        request.add_finalize_fn(tracker)
        schedule_async_save(request)
        return
    save_fsdp_dtensor_checkpoint(directory, model[0], optimizer, iteration, margs, extra=extra)
    torch.distributed.barrier()
    tracker()
    torch.distributed.barrier()


def _write_tracker(filename: str, iteration: int) -> None:
    """Rank 0: Megatron-LM's tracker file names ``iteration`` as the checkpoint to load (written last)."""
    if torch.distributed.get_rank() == 0:
        with open(filename, "w") as tracker:
            tracker.write(str(iteration))


@contextlib.contextmanager
def _prebuilt_dataset_helpers():
    """Skip Megatron's ``make`` of its dataset C++ helpers when the wheel already ships them.

    ``initialize_megatron`` runs ``make -C megatron/core/datasets`` on rank 0; the megatron-core
    wheel carries the compiled ``helpers_cpp`` extension but no Makefile, so ``make`` fails and
    Megatron exits. When the prebuilt module imports, compiling is unnecessary."""
    from megatron.core.datasets import utils as dataset_utils

    has_makefile = os.path.exists(os.path.join(os.path.dirname(dataset_utils.__file__), "Makefile"))
    try:
        from megatron.core.datasets import helpers_cpp  # noqa: F401
        prebuilt = True
    except ImportError:
        prebuilt = False
    original = dataset_utils.compile_helpers
    if prebuilt and not has_makefile:
        dataset_utils.compile_helpers = lambda: logger.info("using the prebuilt megatron dataset helpers")
    try:
        yield
    finally:
        dataset_utils.compile_helpers = original


# ---------------------------------------------------------------------------------------------
# Model, data, forward step (Megatron-LM pretrain_gpt.py, reduced to TP = PP = CP = 1)
# ---------------------------------------------------------------------------------------------


def model_provider(pre_process: bool = True, post_process: bool = True, config=None, pg_collection=None,
                   vp_stage: Optional[int] = None):
    """A bare ``GPTModel`` built from Megatron's global args."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )
    from megatron.training import get_args
    from megatron.training.argument_utils import core_transformer_config_from_args

    args = get_args()
    if config is None:
        config = core_transformer_config_from_args(args)
    if args.transformer_impl == "local":
        spec = get_gpt_layer_local_spec(args.num_experts, args.moe_grouped_gemm, args.qk_layernorm,
                                        normalization=args.normalization)
    else:
        spec = get_gpt_layer_with_transformer_engine_spec(args.num_experts, args.moe_grouped_gemm,
                                                          args.qk_layernorm)
    kwargs = dict(pg_collection=pg_collection) if pg_collection is not None else {}
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        vp_stage=vp_stage,
        **kwargs,
    )


def train_valid_test_datasets_provider(train_val_test_num_samples):
    """Megatron's mock GPT datasets (``MockGPTDataset``), built on every rank."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
    from megatron.training import get_args, get_tokenizer

    args = get_args()
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=None,
        blend_per_split=None,
        tokenizer=get_tokenizer(),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
    )
    return BlendedMegatronDatasetBuilder(MockGPTDataset, train_val_test_num_samples, lambda: True,
                                         config).build()


train_valid_test_datasets_provider.is_distributed = True


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """``(sum of masked token losses, num_tokens, {"lm loss": [sum, num_tokens]})`` (0.19 style)."""
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    report = torch.cat([loss.clone().detach().view(1), num_tokens.float().view(1)])
    return loss, num_tokens, {"lm loss": report}


def forward_step(data_iterator, model):
    """One micro-batch: move it to the GPU, run the model with labels, return the loss function."""
    batch = next(data_iterator)
    device = torch.device("cuda", torch.cuda.current_device())
    batch = {k: (v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
    output = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"), labels=batch["labels"])
    return output, functools.partial(loss_func, batch["loss_mask"])


def exit_with_one_message(error: LauncherArgumentError) -> None:
    """Rank 0 prints ``error`` (one line, no traceback) and every rank exits with status 2, so a
    refused command line reads once however many ranks torchrun started."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"error: {error}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def main(argv: Optional[List[str]] = None) -> None:
    from megatron.core.enums import ModelType
    from megatron.training import pretrain
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.global_vars import set_global_variables

    argv = sys.argv[1:] if argv is None else list(argv)
    if "-h" in argv or "--help" in argv:
        # Megatron-LM 0.19.2's own --help crashes (a help string holds a bare '%').
        print(__doc__)
        return
    try:
        set_up_warnings(argv)           # before parse_args: Megatron warns while its modules import
        args = parse_args(argv)
    except LauncherArgumentError as error:
        exit_with_one_message(error)
    set_global_variables(args)
    cfg = pretrain_cfg_container_from_args(args, model_cfg=None)
    with use_fully_sharded_data_parallel():
        pretrain(cfg, train_valid_test_datasets_provider, ModelType.encoder_or_decoder, forward_step,
                 model_provider=model_provider)


if __name__ == "__main__":
    main()
