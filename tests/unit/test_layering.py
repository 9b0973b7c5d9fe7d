"""The core runs on torch alone: importing every core module must not import megatron."""

import pkgutil
import subprocess
import sys

import megatron_fsdp_v2


def test_core_modules_do_not_import_megatron():
    core = sorted(m.name for m in pkgutil.walk_packages(megatron_fsdp_v2.__path__, "megatron_fsdp_v2.")
                  if not m.name.startswith("megatron_fsdp_v2.megatron"))
    assert "megatron_fsdp_v2.fully_shard" in core and "megatron_fsdp_v2.checkpoint" in core
    code = ("import importlib, sys\n"
            f"for name in {core!r}: importlib.import_module(name)\n"
            "print(sorted(m for m in sys.modules if m == 'megatron' or m.startswith('megatron.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_core_sources_never_mention_a_megatron_import():
    """Lazy imports inside functions count too: the demo and anything Megatron live in megatron/."""
    import pathlib
    import re

    root = pathlib.Path(megatron_fsdp_v2.__file__).parent
    pattern = re.compile(r"^\s*(from\s+megatron(\.|\s)|import\s+megatron(\.|\s|$)|from\s+\.+megatron\b)", re.M)
    offenders = [str(p.relative_to(root)) for p in root.rglob("*.py")
                 if "megatron" not in p.relative_to(root).parts[:-1] and pattern.search(p.read_text())]
    assert offenders == []
