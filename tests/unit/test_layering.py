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
    """Lazy imports inside functions count too: anything Megatron lives in megatron/."""
    import pathlib
    import re

    root = pathlib.Path(megatron_fsdp_v2.__file__).parent
    pattern = re.compile(r"^\s*(from\s+megatron(\.|\s)|import\s+megatron(\.|\s|$)|from\s+\.+megatron\b)", re.M)
    offenders = [str(p.relative_to(root)) for p in root.rglob("*.py")
                 if "megatron" not in p.relative_to(root).parts[:-1] and pattern.search(p.read_text())]
    assert offenders == []


def test_scaffolding_stays_out_of_the_installed_package(monkeypatch):
    """The CPU patches (testing/), the demo and the launcher (examples/) are not library code: setup.py
    does not install them and no library module imports them."""
    import pathlib
    import re
    import runpy

    import setuptools

    root = pathlib.Path(megatron_fsdp_v2.__file__).parent
    repo = root.parent
    setup_kwargs = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kwargs: setup_kwargs.update(kwargs))
    monkeypatch.chdir(repo)                  # setup.py's find_packages() searches the working directory
    runpy.run_path(str(repo / "setup.py"))
    installed = setup_kwargs["packages"]
    assert "megatron_fsdp_v2.megatron" in installed
    assert not [name for name in installed if name.split(".")[0] in ("testing", "examples", "tests")]
    assert (repo / "testing" / "cpu_compat.py").is_file()
    assert (repo / "examples" / "megatron_demo.py").is_file() and (repo / "examples" / "pretrain_gpt.py").is_file()
    modules = {p.stem for p in root.rglob("*.py")}
    assert not modules & {"cpu_compat", "demo", "pretrain_gpt"}, modules
    pattern = re.compile(r"^\s*(from|import)\s+(testing|examples|tests)(\.|\s|$)", re.M)
    offenders = [str(p.relative_to(root)) for p in root.rglob("*.py") if pattern.search(p.read_text())]
    assert offenders == []


def _room(module: str) -> str:
    """The folder (or top-level module) a module of the package belongs to."""
    import pathlib

    parts = module.split(".")
    root = pathlib.Path(megatron_fsdp_v2.__file__).parent
    return parts[1] if len(parts) > 1 and (len(parts) > 2 or (root / parts[1]).is_dir()) else \
        (parts[1] if len(parts) > 1 else "__init__")


def _folder_imports() -> dict:
    """{folder: folders its modules import at module level} (lazy imports inside functions and
    ``if TYPE_CHECKING:`` blocks excluded), from the sources."""
    import ast
    import pathlib

    root = pathlib.Path(megatron_fsdp_v2.__file__).parent
    edges: dict = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        package = parts if parts[-1] == "__init__" else parts[:-1]
        package = [p for p in package if p != "__init__"]
        module = ".".join(p for p in parts if p != "__init__")
        for node in ast.parse(path.read_text()).body:
            if not isinstance(node, ast.ImportFrom):
                continue
            base = package[:len(package) - (node.level - 1)] if node.level else []
            target = ".".join(base + [node.module]) if node.module else ".".join(base)
            if target.startswith("megatron_fsdp_v2") and _room(module) != _room(target):
                edges.setdefault(_room(module), set()).add(_room(target))
    return edges


def test_no_folder_imports_one_that_imports_it_back():
    """Issue 50: the folders are layers (wrap -> runtime -> group -> offload -> comm ...); an import
    that runs back up would tie two of them into one."""
    edges = _folder_imports()
    assert {"wrap", "runtime", "group", "offload", "plan"} <= set(edges), sorted(edges)     # (comm imports none)
    state: dict = {}

    def cycle_from(node, path):
        state[node] = "open"
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                return path + [nxt]
            if nxt not in state and (found := cycle_from(nxt, path + [nxt])):
                return found
        state[node] = "done"
        return None

    cycles = [found for start in sorted(edges) if start not in state and (found := cycle_from(start, [start]))]
    assert cycles == [], cycles
