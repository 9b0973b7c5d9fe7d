"""Every snippet of README.md and docs/*.md that claims to run, runs here as written.

The marker on the line before a fenced block says what it claims (docs/testing.md, "Snippets"):

* ``<!-- snippet: examples/F.py -->``: the block is the file ``F`` verbatim, and ``F`` runs;
* ``<!-- snippet: continues examples/F.py -->``: the block runs after ``F`` (before its last line,
  the teardown), in ``F``'s names;
* ``<!-- snippet: not run: WHY -->``: not run here, ``WHY`` says why (a GPU, a Megatron wrapper);
* ``<!-- snippet: run -->`` on a ```bash block: its command runs from the repository root
  (``torchrun`` and ``python`` are this interpreter's), each distinct command once.

Every ```python block carries one; a ```bash block without one claims nothing here. The Python
snippets run in one torchrun job of 2 gloo ranks (tests/snippet_driver.py); each command in its
own. A torchrun child that exits with SIGABRT (-6) after printing its final line is torch's gloo
teardown at interpreter exit (pytorch/pytorch#179291, docs/troubleshooting.md), not the snippet:
the job reruns, at most three times (2 of 10 runs of the Python job aborted so on 2026-12-07 on a
loaded 2-core machine: once would leave a 4% chance of a false failure, three 0.2%), and the test
says so on stderr.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys
from typing import Callable, Dict, List, NamedTuple

import pytest

from tests.dist_pool import free_port

REPO = pathlib.Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
MARKER = re.compile(r"^<!-- snippet: (.+?) -->$")
NOT_RUN = re.compile(r"^not run: .{10,}$")
#: How often a job whose child aborted at exit (after its final line) runs again.
EXIT_ABORT_RERUNS = 3
#: A line of a warning: Python's (``...Warning:``), a log record's (``WARNING:``), torch's C++ log
#: (``W1207 ...``), and our summary of notices (``note: ...``).
WARNING_LINE = re.compile(r"warning|^(\[rank\d+\]:)?W\d{4} |^note: ", re.I)


class Snippet(NamedTuple):
    doc: pathlib.Path
    line: int              # the fence's line, 1-based
    language: str
    marker: str            # what follows "snippet: ", or "" without a marker
    code: str

    @property
    def where(self) -> str:
        return f"{self.doc.relative_to(REPO)}:{self.line}"


def snippets(doc: pathlib.Path) -> List[Snippet]:
    """The fenced ```python and ```bash blocks of ``doc``, with the marker before each."""
    lines, found, i = doc.read_text().split("\n"), [], 0
    while i < len(lines):
        fence = re.match(r"^```(python|bash)\s*$", lines[i])
        if not fence:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marker = MARKER.match(before)
        found.append(Snippet(doc, i + 1, fence.group(1), marker.group(1) if marker else "",
                             "\n".join(lines[i + 1:end]) + "\n"))
        i = end + 1
    return found


ALL = [s for doc in DOCS for s in snippets(doc)]
PYTHON = [s for s in ALL if s.language == "python"]
COMMANDS = sorted({s.code for s in ALL if s.language == "bash" and s.marker == "run"})


def _kind(marker: str) -> str:
    if NOT_RUN.match(marker):
        return "not run"
    if marker.startswith("continues "):
        return "continues"
    return "file" if marker.endswith(".py") and " " not in marker else "?"


def test_every_python_snippet_says_whether_it_runs():
    assert len(PYTHON) >= 10 and any(s.doc.name == "README.md" for s in PYTHON)
    unmarked = [f"{s.where} ({s.marker or 'no marker'})" for s in PYTHON if _kind(s.marker) == "?"]
    assert unmarked == [], "each ```python block needs a snippet marker: " + ", ".join(unmarked)
    bad_bash = [s.where for s in ALL if s.language == "bash" and s.marker not in ("", "run")]
    assert bad_bash == []


def test_file_snippets_are_their_files_verbatim():
    files = [s for s in PYTHON if _kind(s.marker) == "file"]
    assert {s.marker for s in files} == {"examples/train_loop.py"}
    for s in files:
        assert s.code == (REPO / s.marker).read_text(), f"{s.where} differs from {s.marker}"


def _torchrun(args: List[str], cwd: Callable[[int], pathlib.Path], done: str, ranks: int) -> subprocess.CompletedProcess:
    """``torchrun ARGS`` as this interpreter's module, in ``cwd(attempt)``; run again where a child
    died of SIGABRT after ``ranks`` ranks printed ``done`` (gloo's exit abort, not a failure of the
    command)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    for attempt in range(EXIT_ABORT_RERUNS + 1):
        env["PET_MASTER_PORT"] = str(free_port())       # torchrun's --master-port, without changing the command
        out = subprocess.run([sys.executable, "-m", "torch.distributed.run", *args], cwd=cwd(attempt), env=env,
                             capture_output=True, text=True, timeout=300)
        text = out.stdout + out.stderr
        aborted_at_exit = out.returncode != 0 and "exitcode  : -6" in text and text.count(done) >= ranks
        if not aborted_at_exit:
            return out
        print(f"{args}: a child aborted at exit after its final line (gloo's teardown); rerun {attempt + 1}",
              file=sys.stderr)
    return out


def test_python_snippets_run_as_written_on_two_gloo_ranks(tmp_path):
    """examples/train_loop.py, then every snippet that continues it: no error, no warning."""
    (source,) = {s.marker for s in PYTHON if _kind(s.marker) == "file"}
    continuing = [s for s in PYTHON if _kind(s.marker) == "continues"]
    assert {s.marker for s in continuing} == {f"continues {source}"}
    assert (REPO / source).read_text().rstrip("\n").endswith("\ndist.destroy_process_group()")
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"file": str(REPO / source), "text": (REPO / source).read_text(),
                                "snippets": [[s.where, s.code] for s in continuing]}))
    def fresh_directory(attempt: int) -> pathlib.Path:      # what an aborted attempt saved is not there
        (tmp_path / f"run{attempt}").mkdir()
        return tmp_path / f"run{attempt}"

    out = _torchrun(["--nproc-per-node", "2", str(REPO / "tests" / "snippet_driver.py"), str(plan)], fresh_directory,
                    "all snippets ran", 2)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-6000:]
    for rank in range(2):
        # (no ^...$: two ranks print to one pipe, and a line of one can run into the other's)
        assert re.search(rf"rank {rank}: \|head\.weight\| = \d+\.\d{{4}}", out.stdout), out.stdout
        for s in continuing:
            assert f"rank {rank}: snippet {s.where} ran" in out.stdout
    assert [line for line in text.splitlines() if "Warning" in line] == []      # summon's norm: no scalar warning
    assert [p.name for p in tmp_path.glob("run*/model.pt")]


@pytest.fixture(scope="module")
def command_outputs() -> Dict[str, subprocess.CompletedProcess]:
    outputs = {}
    for command in COMMANDS:
        argv = command.replace("\\\n", " ").split()
        if argv[0] == "torchrun":
            outputs[command] = _torchrun(argv[1:], lambda attempt: REPO, "[after training is done]", 1)
        else:
            assert argv[0] == "python", command
            env = dict(os.environ, PYTHONPATH=str(REPO))
            outputs[command] = subprocess.run([sys.executable, *argv[1:]], cwd=REPO, env=env, capture_output=True,
                                              text=True, timeout=300)
    return outputs


def test_bash_snippets_marked_run_run_as_written(command_outputs):
    assert len(COMMANDS) >= 2
    for command, out in command_outputs.items():
        assert out.returncode == 0, f"{command}\n{(out.stdout + out.stderr)[-6000:]}"


def _one(command_outputs, needle: str) -> str:
    (text,) = [out.stdout + out.stderr for command, out in command_outputs.items() if needle in command]
    return text


def test_cpu_launcher_trains_with_at_most_20_warning_lines(command_outputs):
    """README's Megatron-FSDP command line on CPU: 4 iterations, and of the warnings only those a
    user acts on or that no tool of ours controls (torchrun's own banner, Megatron's one_logger
    print): 939 lines with 50 warning lines before the notices were summarized."""
    text = _one(command_outputs, "testing/pretrain_gpt_cpu.py")
    assert re.search(r"iteration\s+4/\s+4 \|", text)
    warning_lines = [line for line in text.splitlines() if WARNING_LINE.search(line)]
    assert len(warning_lines) <= 20, "\n".join(warning_lines)
    assert "Traceback" not in text


def test_plan_command_prints_at_most_100_columns(command_outputs):
    text = _one(command_outputs, "python -m megatron_fsdp_v2.plan")
    assert "optim_grads_params 2x4" in text
    assert max(len(line) for line in text.splitlines()) <= 100, max(text.splitlines(), key=len)


def test_snippets_not_run_compile_and_import_what_they_name():
    """A snippet not run here still parses, and each ``from X import Y`` in it finds ``Y``: a module
    moved since the docs were written fails here (megatron_fsdp_v2.megatron.fsdp_dtensor_format did)."""
    import ast
    import importlib

    checked = 0
    for s in PYTHON:
        if _kind(s.marker) != "not run":
            continue
        tree = ast.parse(s.code, s.where)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                module = importlib.import_module(node.module)
                missing = [a.name for a in node.names if not hasattr(module, a.name)]
                assert missing == [], f"{s.where}: {node.module} has no {missing}"
                checked += 1
    assert checked >= 3


def test_api_page_names_every_public_name_argument_and_method():
    """docs/api.md stays complete: both packages' ``__all__``, ``fully_shard``'s and ``plan``'s
    arguments, the wrapped module's public methods; and the README links it."""
    import inspect

    import megatron_fsdp_v2
    import megatron_fsdp_v2.megatron
    from megatron_fsdp_v2 import FullyShardedModule

    page = (REPO / "docs" / "api.md").read_text()
    named = set(re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)", page))
    wanted = {
        "megatron_fsdp_v2.__all__": set(megatron_fsdp_v2.__all__),
        "megatron_fsdp_v2.megatron.__all__": set(megatron_fsdp_v2.megatron.__all__),
        "fully_shard's arguments": set(inspect.signature(megatron_fsdp_v2.fully_shard).parameters) - {"module"},
        "plan's arguments": set(inspect.signature(megatron_fsdp_v2.plan).parameters) - {"module"},
        "FullyShardedModule's methods": {n for n in vars(FullyShardedModule) if not n.startswith("_")},
    }
    missing = {what: sorted(names - named - set(re.findall(r"\b(\w+)=", page))) for what, names in wanted.items()}
    assert all(not names for names in missing.values()), missing
    assert "(docs/api.md)" in (REPO / "README.md").read_text()
