"""examples/pretrain_gpt.py shows each of Megatron's warnings once per process, and the notices that
need no action as one line per kind (megatron_fsdp_v2/notices.py; tests/unit/test_notices.py);
``--verbose`` keeps Megatron's default (every issuing line once, every log call). A refused command
line reads once, on rank 0."""

from __future__ import annotations

import importlib.util
import logging
import uuid
import warnings

import pytest

if importlib.util.find_spec("megatron.core") is None:
    pytest.skip("megatron-core is not installed", allow_module_level=True)

from .test_megatron_adapter import LAUNCHER_ARGS  # noqa: E402

GPT_LOGGER = "megatron.core.models.gpt.gpt_model"


def _shown_twice_from_two_modules(text: str, shown: list) -> int:
    """How many times ``text`` reaches ``shown`` when two Megatron modules issue it (as "Apex is not installed")."""
    for line, module in ((1, "megatron.core.models.backends"), (2, "megatron.core.models.gpt.gpt_layer_specs")):
        warnings.warn_explicit(text, UserWarning, f"/site-packages/{module.replace('.', '/')}.py", line,
                               module=module, registry={})
    return sum(str(message) == text for message in shown)


def _recorded() -> list:
    """Python's default filters, and ``warnings.showwarning`` recording the messages shown (inside catch_warnings)."""
    warnings.simplefilter("default")        # Python's own for UserWarning, whatever pytest was given
    shown = []
    warnings.showwarning = lambda message, *args, **kwargs: shown.append(message)
    return shown


def _logged_twice(text: str) -> int:
    """How many times a message Megatron logs per model built ("GPTModel IS DEPRECATED") reaches a handler."""
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        for _ in range(2):
            logging.getLogger(GPT_LOGGER).warning(text)
    finally:
        root.removeHandler(handler)
    return sum(r.getMessage() == text for r in records)


@pytest.fixture
def launcher():
    """The launcher module; the logger filters it installs are removed afterwards (warnings' filters
    are restored by each test's catch_warnings)."""
    from examples import pretrain_gpt
    from megatron_fsdp_v2.notices import stop_summarizing

    yield pretrain_gpt
    stop_summarizing()
    for name in pretrain_gpt.REPEATING_MEGATRON_LOGGERS:
        for f in [f for f in logging.getLogger(name).filters if isinstance(f, pretrain_gpt.OncePerMessage)]:
            logging.getLogger(name).removeFilter(f)


def test_verbose_flag_is_the_launchers_and_takes_no_value(launcher):
    assert launcher.take_verbose_flag(["--lr", "1e-3", "--verbose", "--bf16"]) == (["--lr", "1e-3", "--bf16"], True)
    assert launcher.take_verbose_flag(["--lr", "1e-3"]) == (["--lr", "1e-3"], False)
    with pytest.raises(ValueError, match=r"--verbose takes no value, got '--verbose=1'; allowed: --verbose alone"):
        launcher.take_verbose_flag(["--verbose=1"])
    assert launcher.parse_args(LAUNCHER_ARGS + ["--verbose"]).verbose is True    # Megatron's parser never sees it
    assert launcher.parse_args(LAUNCHER_ARGS).verbose is False


def test_repeated_warnings_show_once_without_verbose(launcher):
    with warnings.catch_warnings():
        shown = _recorded()
        before = list(warnings.filters)
        assert launcher.set_up_warnings(LAUNCHER_ARGS) is True
        assert warnings.filters == before                       # no filter changes: categories as they were
        assert _shown_twice_from_two_modules(f"Megatron says {uuid.uuid4()}", shown) == 1
        assert _logged_twice(f"GPT says {uuid.uuid4()}") == 1
        assert _shown_twice_from_two_modules(f"Apex is not installed {uuid.uuid4()}", shown) == 0   # a notice:
        assert _logged_twice(f"GPTModel IS DEPRECATED {uuid.uuid4()}") == 0                         # summarized
        for line in (1, 2):                                      # another package's: as before
            warnings.warn_explicit("elsewhere", UserWarning, "/my_pkg/x.py", line, module="my_pkg", registry={})
        assert [str(m) for m in shown].count("elsewhere") == 2
        launcher.set_up_warnings(LAUNCHER_ARGS)                  # idempotent
        assert len(logging.getLogger(GPT_LOGGER).filters) == 2            # once per message, the notices
        assert _shown_twice_from_two_modules(f"Megatron says {uuid.uuid4()}", shown) == 1


def test_verbose_keeps_megatrons_default(launcher):
    with warnings.catch_warnings():
        shown = _recorded()
        show = warnings.showwarning
        assert launcher.set_up_warnings(LAUNCHER_ARGS + ["--verbose"]) is False
        assert warnings.showwarning is show
        assert _shown_twice_from_two_modules(f"Apex is not installed {uuid.uuid4()}", shown) == 2
        assert _logged_twice(f"GPTModel IS DEPRECATED {uuid.uuid4()}") == 2


@pytest.mark.parametrize("rank, printed", [("0", 1), ("1", 0)])
def test_megatron_fsdp_without_fsdp_dtensor_stops_with_one_message_naming_the_flag(launcher, monkeypatch, capsys,
                                                                                  rank, printed):
    """Megatron-LM would stop on its assertion with a traceback per rank; the launcher says it once."""
    monkeypatch.setenv("RANK", rank)
    with warnings.catch_warnings():
        with pytest.raises(SystemExit) as exit_info:
            launcher.main(LAUNCHER_ARGS + ["--use-megatron-fsdp", "--use-distributed-optimizer"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    want = ("error: examples/pretrain_gpt.py: --use-megatron-fsdp needs --ckpt-format fsdp_dtensor (Megatron-LM's "
            "validation demands it with Megatron-FSDP), got --ckpt-format torch_dist; add --ckpt-format fsdp_dtensor.")
    assert err.count(want) == printed and ("Traceback" in err) is False
    with pytest.raises(launcher.LauncherArgumentError, match="--use-megatron-fsdp needs --ckpt-format fsdp_dtensor"):
        launcher.parse_args(LAUNCHER_ARGS + ["--use-megatron-fsdp"])
    from megatron.training import arguments

    monkeypatch.setattr(arguments, "get_device_arch_version", lambda: 9)     # validation reads the GPU: Hopper's
    assert launcher.parse_args(LAUNCHER_ARGS + ["--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor"]) \
        .megatron_fsdp_command_line is True
