"""The package's layering: the core runs on torch alone (importing every core module must not import
megatron), folders import one way, no two modules import each other (imports inside functions
count), and the group's parts use only the group's public attributes."""

import ast
import pathlib
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


PACKAGE = pathlib.Path(megatron_fsdp_v2.__file__).parent


def _is_type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and ((isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or
                                         (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _imports_anywhere(tree: ast.AST) -> list:
    """Every import statement of a module, inside functions too, but not under ``if TYPE_CHECKING:``
    (its ``else:`` branch runs, so it counts)."""
    found = []

    def visit(node):
        if _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def module_import_graph(root: pathlib.Path) -> dict:
    """{module: {(imported module of the package, line)}} for the package at ``root``; ``from X import
    Y`` is an edge to the module X.Y where Y is one, else to X (a package's ``__init__``)."""
    modules = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        modules[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    edges: dict = {}
    for name, (path, is_package) in modules.items():
        package = name.split(".") if is_package else name.split(".")[:-1]
        for node in _imports_anywhere(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = package[:len(package) - (node.level - 1)] if node.level else []
                source = ".".join(base + ([node.module] if node.module else []))
                targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source
                           for alias in node.names]
            edges.setdefault(name, set()).update((t, node.lineno) for t in targets if t in modules and t != name)
    return edges


def find_cycle(edges: dict):
    """One import cycle as ["a:line", "b:line", ..., "a"] (each module with the line of its import of
    the next), or None."""
    state: dict = {}

    def walk(node, above):
        state[node] = "open"
        for target, line in sorted(edges.get(node, ())):
            path = above + [f"{node}:{line}"]
            if state.get(target) == "open":
                start = next(i for i, step in enumerate(path) if step.rsplit(":", 1)[0] == target)
                return path[start:] + [target]
            if target not in state and (found := walk(target, path)):
                return found
        state[node] = "done"
        return None

    for start in sorted(edges):
        if start not in state and (found := walk(start, [])):
            return found
    return None


def test_no_module_imports_one_that_imports_it_back(tmp_path):
    """Issue 65: an import inside a function hides a cycle from the import system, not from the
    design; each concept depends one way."""
    edges = module_import_graph(PACKAGE)
    assert "megatron_fsdp_v2.comm.ledger" in {target for target, _ in edges["megatron_fsdp_v2.comm.collectives"]}
    assert find_cycle(edges) is None, " -> ".join(find_cycle(edges))
    probe = tmp_path / "probe"                  # the check sees a cycle hidden in a function
    probe.mkdir()
    (probe / "__init__.py").write_text("")
    (probe / "a.py").write_text("from .b import B\nA = 1\n")
    (probe / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import A\n"
                                "B = 2\ndef f():\n    from . import a\n    return a.A\n")
    assert find_cycle(module_import_graph(probe)) == ["probe.a:1", "probe.b:6", "probe.a"]
    (probe / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import A\nB = 2\n")
    assert find_cycle(module_import_graph(probe)) is None


def _private_names(path: pathlib.Path, class_name: str) -> set:
    """The underscore names (not dunders) a class declares or defines: attributes and methods."""
    cls = next(node for node in ast.parse(path.read_text()).body
               if isinstance(node, ast.ClassDef) and node.name == class_name)
    names = {node.target.id for node in cls.body if isinstance(node, ast.AnnAssign)}
    names |= {node.name for node in cls.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def _underscore_reads_off_others(path: pathlib.Path, names=None) -> list:
    """``x._name`` where ``x`` is not ``self``/``cls`` (only ``names`` if given; dunders never)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
            continue
        if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            continue
        if names is None or node.attr in names:
            found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return found


# a tensor's version counter (group/main_weights.py); the kernel FSDP2 copies gradients into its
# reduce-scatter input with (group/unreduced_grads.py)
TORCH_UNDERSCORE_NAMES = {"_version", "_chunk_cat"}


def test_the_group_parts_use_only_the_groups_public_attributes():
    """Issue 65: the group's parts (levels, reduce, export, offload, ...) reach the group through its
    public verbs and attributes, and no module of the package reads ParamGroup's private ones."""
    private = _private_names(PACKAGE / "group" / "param_group.py", "ParamGroup")
    assert {"_stash_key", "_pending_unshard", "_init_buffers"} <= private
    in_group = [hit for path in sorted((PACKAGE / "group").glob("*.py"))
                for hit in _underscore_reads_off_others(path) if hit.rsplit(".", 1)[1] not in TORCH_UNDERSCORE_NAMES]
    elsewhere = [hit for path in sorted(PACKAGE.rglob("*.py")) if path.name != "param_group.py"
                 for hit in _underscore_reads_off_others(path, private)]
    assert in_group == [] and elsewhere == []


def test_the_private_read_check_finds_a_read_off_another_object(tmp_path):
    probe = tmp_path / "part.py"
    probe.write_text("class P:\n    def f(self, group):\n        self._own = group._stash_key\n"
                     "        return group.grads, group.__class__\n")
    assert _underscore_reads_off_others(probe) == ["part.py:3: group._stash_key"]
    assert _underscore_reads_off_others(probe, {"_other"}) == []
