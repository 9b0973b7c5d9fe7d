"""examples/pretrain_gpt.py shows each of Megatron's warnings once per process; ``--verbose``
keeps Megatron's default (every issuing line once, every log call)."""

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

    yield pretrain_gpt
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
        assert _shown_twice_from_two_modules(f"Apex is not installed {uuid.uuid4()}", shown) == 1
        assert _logged_twice(f"GPTModel IS DEPRECATED {uuid.uuid4()}") == 1
        for line in (1, 2):                                      # another package's: as before
            warnings.warn_explicit("elsewhere", UserWarning, "/my_pkg/x.py", line, module="my_pkg", registry={})
        assert [str(m) for m in shown].count("elsewhere") == 2
        launcher.set_up_warnings(LAUNCHER_ARGS)                  # idempotent
        assert len(logging.getLogger(GPT_LOGGER).filters) == 1
        assert _shown_twice_from_two_modules(f"Apex is not installed {uuid.uuid4()}", shown) == 1


def test_verbose_keeps_megatrons_default(launcher):
    with warnings.catch_warnings():
        shown = _recorded()
        show = warnings.showwarning
        assert launcher.set_up_warnings(LAUNCHER_ARGS + ["--verbose"]) is False
        assert warnings.showwarning is show
        assert _shown_twice_from_two_modules(f"Apex is not installed {uuid.uuid4()}", shown) == 2
        assert _logged_twice(f"GPTModel IS DEPRECATED {uuid.uuid4()}") == 2
