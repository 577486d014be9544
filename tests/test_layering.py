"""Import layering rules, checked statically with ``ast`` (nothing under test is imported).

Pure modules (hashing, block pool, model spec, the scheduler, and later the transfer lanes and
KV layout) must stay free of torch, networking, clocks and concurrency, directly or through any
``dualpath`` module they import. Every import statement counts, including ones inside functions
(they run when the function is called); only ``if TYPE_CHECKING:`` blocks are exempt.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = "dualpath"

FORBIDDEN = frozenset(
    {"torch", "zmq", "socket", "time", "datetime", "asyncio", "threading", "multiprocessing"}
)

REQUIRED_PURE = ("dualpath/kv/hashing.py", "dualpath/kv/block_pool.py", "dualpath/kv/block_plan.py",
                 "dualpath/model/spec.py",
                 "dualpath/server/router/state.py", "dualpath/server/router/types.py",
                 "dualpath/server/router/ledger.py", "dualpath/server/router/placement.py",
                 "dualpath/server/router/endings.py", "dualpath/server/router/membership.py",
                 "dualpath/vocab.py",
                 "dualpath/regime.py", "dualpath/ending.py", "dualpath/sessions.py",
                 "dualpath/kv/retention.py", "dualpath/kv/layer_groups.py",
                 "dualpath/server/router/sessions.py", "dualpath/server/router/prefetch.py")
OPTIONAL_PURE = ("dualpath/traffic/lanes.py", "dualpath/traffic/token_bucket.py",
                 "dualpath/kv/layout.py")
PURE_TREES = ("dualpath/scheduler",)


# --- the checker -----------------------------------------------------------------------------


def module_name(path: Path, root: Path) -> str:
    """``root/dualpath/kv/hashing.py`` -> ``dualpath.kv.hashing`` (packages drop __init__)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def module_file(name: str, root: Path) -> Path | None:
    """The file that defines module ``name`` under ``root``, or None if there is none."""
    base = root.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _walk_runtime(node: ast.AST) -> Iterator[ast.AST]:
    """Like ``ast.walk`` but skipping the bodies of ``if TYPE_CHECKING:`` blocks."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for other in child.orelse:
                yield other
                yield from _walk_runtime(other)
            continue
        yield child
        yield from _walk_runtime(child)


def _resolve_relative(package: str, level: int, module: str | None) -> str:
    parts = package.split(".")
    if level - 1 > len(parts) - 1:
        raise ValueError(f"relative import beyond top-level package from {package}")
    base = parts[: len(parts) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def imported_names(path: Path, root: Path) -> list[str]:
    """Absolute names of every module ``path`` imports (``from p import m`` yields p and p.m)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    this = module_name(path, root)
    package = this if path.name == "__init__.py" else this.rpartition(".")[0]
    names: list[str] = []
    for node in _walk_runtime(tree):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = (_resolve_relative(package, node.level, node.module) if node.level
                    else node.module or "")
            names.append(base)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if alias.name != "*" and module_file(sub, root) is not None:
                    names.append(sub)
        elif (isinstance(node, ast.Call) and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
              and ((isinstance(node.func, ast.Name)
                    and node.func.id in {"__import__", "import_module"})
                   or (isinstance(node.func, ast.Attribute)
                       and node.func.attr == "import_module"))):
            names.append(node.args[0].value)
    return names


def _with_parents(name: str) -> list[str]:
    """``a.b.c`` -> ``[a, a.b, a.b.c]``: importing a module runs its packages' __init__ too."""
    parts = name.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


def find_violations(start: Path, is_forbidden: Callable[[str], bool],
                    root: Path = ROOT) -> list[list[str]]:
    """Import chains from ``start`` to a forbidden module, following in-package imports.

    Each chain lists module names, starting with ``start``'s and ending with the forbidden
    import. Breadth-first, so every reported chain is a shortest one.
    """
    top = module_name(start, root).split(".")[0]
    first = module_name(start, root)
    queue: deque[list[str]] = deque()
    seen: set[str] = set()
    for parent in _with_parents(first):
        if module_file(parent, root) is not None:
            seen.add(parent)
            queue.append([first] if parent == first else [first, parent])
    violations: list[list[str]] = []
    while queue:
        chain = queue.popleft()
        path = module_file(chain[-1], root)
        assert path is not None
        for name in imported_names(path, root):
            if is_forbidden(name):
                if [*chain, name] not in violations:
                    violations.append([*chain, name])
                continue
            if name.split(".")[0] != top:
                continue
            for target in _with_parents(name):
                if target in seen or module_file(target, root) is None:
                    continue
                seen.add(target)
                if is_forbidden(target):
                    violations.append([*chain, target])
                else:
                    queue.append([*chain, target])
    return violations


def is_forbidden_dependency(name: str) -> bool:
    return name.split(".")[0] in FORBIDDEN


def format_violations(start: Path, violations: list[list[str]], root: Path = ROOT) -> str:
    lines = [f"{start.relative_to(root)} must not import {sorted(FORBIDDEN)}, but:"]
    lines += ["  " + " -> ".join(chain) for chain in violations]
    return "\n".join(lines)


def pure_files(root: Path = ROOT) -> list[Path]:
    files = [root / p for p in REQUIRED_PURE]
    for tree in PURE_TREES:
        if (root / tree).is_dir():
            files += sorted((root / tree).rglob("*.py"))
    files += [root / p for p in OPTIONAL_PURE if (root / p).is_file()]
    return files


# --- the rules -------------------------------------------------------------------------------


def test_required_pure_modules_exist():
    missing = [p for p in REQUIRED_PURE if not (ROOT / p).is_file()]
    assert not missing, f"pure modules moved or deleted, update the layering test: {missing}"


@pytest.mark.parametrize("path", pure_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_pure_module_has_no_forbidden_imports(path):
    violations = find_violations(path, is_forbidden_dependency)
    assert not violations, format_violations(path, violations)


MODEL_FILES = sorted((ROOT / "dualpath" / "model").rglob("*.py"))


def _is_kv(name: str) -> bool:
    return name == "dualpath.kv" or name.startswith("dualpath.kv.")


@pytest.mark.parametrize("path", MODEL_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_model_never_imports_kv(path):
    violations = find_violations(path, _is_kv)
    assert not violations, "\n".join(
        [f"{path.relative_to(ROOT)} must not import dualpath.kv, but:"]
        + ["  " + " -> ".join(chain) for chain in violations]
    )


def _run_python(code: str) -> str:
    env = {**os.environ}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                         capture_output=True, text=True, check=True)
    return out.stdout.strip()


def test_import_dualpath_loads_no_torch():
    loaded = _run_python(
        "import sys, dualpath; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    )
    assert loaded == "[]", f"`import dualpath` pulled in torch modules: {loaded}"


def test_importing_pure_modules_loads_no_torch():
    modules = ", ".join(module_name(p, ROOT) for p in pure_files())
    loaded = _run_python(
        f"import sys, {modules}; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    )
    assert loaded == "[]", f"importing {modules} pulled in torch modules: {loaded}"


# Optional extras: the package (top-level import name) -> the only modules that may import it.
# Everything else, `import dualpath` and the local launcher included, must work without them.
OPTIONAL_EXTRAS = {"ray": ("dualpath/server/launch_ray.py",),
                   "vllm": ("dualpath/integrations/vllm/connector.py",
                            "dualpath/integrations/vllm/setup.py",
                            "dualpath/bench/engine/peer_vllm.py")}


def extra_imports(extra: str, root: Path = ROOT) -> list[str]:
    """Package modules, other than the extra's own, with an import statement of ``extra``."""
    allowed = {root / p for p in OPTIONAL_EXTRAS[extra]}
    return [str(path.relative_to(root)) for path in sorted((root / PKG).rglob("*.py"))
            if path not in allowed
            and any(name.split(".")[0] == extra for name in imported_names(path, root))]


@pytest.mark.parametrize("extra", sorted(OPTIONAL_EXTRAS))
def test_optional_extra_is_imported_only_by_its_modules(extra):
    offenders = extra_imports(extra)
    assert not offenders, f"only {OPTIONAL_EXTRAS[extra]} may import {extra}: {offenders}"


def test_import_dualpath_and_the_local_launcher_load_no_optional_extra():
    extras = sorted(OPTIONAL_EXTRAS)
    loaded = _run_python(
        "import sys, dualpath, dualpath.cli, dualpath.server.launch; "
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {extras!r}))"
    )
    assert loaded == "[]", f"`import dualpath` or the local launcher pulled in {loaded}"


# --- the import graph is acyclic; argparse lives in cli.py alone -----------------------------


def import_graph(root: Path = ROOT) -> dict[str, list[str]]:
    """Each module of the package -> the package modules its import statements name (imports
    inside functions count; ``if TYPE_CHECKING:`` ones do not)."""
    files = {module_name(path, root): path for path in sorted((root / PKG).rglob("*.py"))}
    return {name: sorted({n for n in imported_names(path, root) if n in files and n != name})
            for name, path in files.items()}


def import_cycles(graph: dict[str, list[str]]) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) through each strongly connected component of ``graph``
    that has more than one module (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, targets = work[-1]
            target = next(targets, None)
            if target is not None:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(graph[target])))
                elif target in on_stack:
                    low[node] = min(low[node], index[target])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return [_cycle_through(graph, set(c), c[0]) for c in components]


def _cycle_through(graph: dict[str, list[str]], members: set[str], start: str) -> list[str]:
    """A shortest import chain from ``start`` back to itself within ``members``."""
    paths = {start: [start]}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for target in graph[node]:
            if target == start:
                return [*paths[node], start]
            if target in members and target not in paths:
                paths[target] = [*paths[node], target]
                queue.append(target)
    raise AssertionError(f"no cycle through {start}")


def test_the_import_graph_has_no_cycle():
    cycles = import_cycles(import_graph())
    assert not cycles, "import cycles (break each, e.g. by moving what both sides need):\n" + (
        "\n".join("  " + " -> ".join(cycle) for cycle in cycles))


CLI = "dualpath/cli.py"  # the one module that parses command lines
NAMESPACE = re.compile(r"\b(argparse\.)?Namespace\b")


def argparse_users(root: Path = ROOT) -> list[str]:
    """Package files, other than :data:`CLI`, that import argparse at run time or annotate
    anything (a parameter, a return, a variable) with ``Namespace``."""
    offenders = []
    for path in sorted((root / PKG).rglob("*.py")):
        rel = str(path.relative_to(root))
        if rel == CLI:
            continue
        if "argparse" in (n.split(".")[0] for n in imported_names(path, root)):
            offenders.append(f"{rel}: imports argparse")
        tree = ast.parse(path.read_text(), filename=rel)
        for node in ast.walk(tree):
            annotations = []
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                arguments = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs,
                             node.args.vararg, node.args.kwarg]
                annotations = [a.annotation for a in arguments if a is not None]
                annotations.append(node.returns)
            elif isinstance(node, ast.AnnAssign):
                annotations = [node.annotation]
            for annotation in annotations:
                if annotation is not None and NAMESPACE.search(ast.unparse(annotation)):
                    offenders.append(f"{rel}:{annotation.lineno}: annotated with "
                                     f"{ast.unparse(annotation)}")
    return offenders


def test_only_the_cli_parses_command_lines():
    offenders = argparse_users()
    assert not offenders, (f"argparse belongs to {CLI} (a command module has add_arguments and "
                           "an options dataclass):\n" + "\n".join(offenders))


# --- self-tests of the checker ---------------------------------------------------------------


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_checker_finds_transitive_forbidden_import(tmp_path):
    _write(tmp_path, {
        "dualpath/__init__.py": "",
        "dualpath/pure.py": "from dualpath import helper\n",
        "dualpath/helper.py": "from .sub.deep import x\n",
        "dualpath/sub/__init__.py": "",
        "dualpath/sub/deep.py": "def f():\n    import threading\nx = 1\n",
    })
    start = tmp_path / "dualpath" / "pure.py"
    violations = find_violations(start, is_forbidden_dependency, tmp_path)
    assert violations == [
        ["dualpath.pure", "dualpath.helper", "dualpath.sub.deep", "threading"]
    ]
    message = format_violations(start, violations, tmp_path)
    assert "dualpath/pure.py" in message
    assert "dualpath.pure -> dualpath.helper -> dualpath.sub.deep -> threading" in message


def test_checker_finds_forbidden_import_in_a_parent_package_init(tmp_path):
    _write(tmp_path, {
        "dualpath/__init__.py": "",
        "dualpath/a/__init__.py": "import torch.nn as nn\n",
        "dualpath/a/b.py": "",
        "dualpath/c.py": "import dualpath.a.b\n",
    })
    start = tmp_path / "dualpath" / "c.py"
    assert find_violations(start, is_forbidden_dependency, tmp_path) == [
        ["dualpath.c", "dualpath.a", "torch.nn"]
    ]
    # the module's own package __init__ counts too
    assert find_violations(tmp_path / "dualpath" / "a" / "b.py", is_forbidden_dependency,
                           tmp_path) == [["dualpath.a.b", "dualpath.a", "torch.nn"]]


@pytest.mark.parametrize(
    "source",
    ["import time\n", "from datetime import datetime\n", "import socket as s\n",
     "from asyncio import run\n", "import multiprocessing.pool\n", "import zmq\n",
     "import importlib\nimportlib.import_module('torch')\n", "__import__('threading')\n"],
    ids=lambda source: source.strip().splitlines()[-1],
)
def test_checker_flags_each_import_form(tmp_path, source):
    _write(tmp_path, {"dualpath/__init__.py": "", "dualpath/m.py": source})
    violations = find_violations(tmp_path / "dualpath" / "m.py", is_forbidden_dependency, tmp_path)
    assert len(violations) == 1
    assert violations[0][0] == "dualpath.m"
    assert violations[0][-1].split(".")[0] in FORBIDDEN


def test_checker_accepts_clean_and_type_checking_imports(tmp_path):
    _write(tmp_path, {
        "dualpath/__init__.py": "",
        "dualpath/ok.py": (
            "from __future__ import annotations\n"
            "import hashlib\nimport numpy as np\nfrom typing import TYPE_CHECKING\n"
            "from dualpath import other\n"
            "if TYPE_CHECKING:\n    import torch\n"
            "timeout = 3  # the word time in a name is fine\n"
        ),
        "dualpath/other.py": "import collections\n",
    })
    assert find_violations(tmp_path / "dualpath" / "ok.py", is_forbidden_dependency,
                           tmp_path) == []


def test_checker_follows_relative_parent_imports(tmp_path):
    _write(tmp_path, {
        "dualpath/__init__.py": "",
        "dualpath/kv/__init__.py": "",
        "dualpath/kv/x.py": "import socket\n",
        "dualpath/model/__init__.py": "",
        "dualpath/model/m.py": "from ..kv import x\n",
    })
    start = tmp_path / "dualpath" / "model" / "m.py"
    assert find_violations(start, _is_kv, tmp_path) == [
        ["dualpath.model.m", "dualpath.kv"], ["dualpath.model.m", "dualpath.kv.x"]
    ]
    assert find_violations(start, is_forbidden_dependency, tmp_path) == [
        ["dualpath.model.m", "dualpath.kv.x", "socket"]
    ]


def test_pure_files_pick_up_scheduler_and_optional_modules(tmp_path):
    _write(tmp_path, {p: "" for p in REQUIRED_PURE})
    assert pure_files(tmp_path) == [tmp_path / p for p in REQUIRED_PURE]
    _write(tmp_path, {
        "dualpath/scheduler/__init__.py": "",
        "dualpath/scheduler/policy/select.py": "",
        "dualpath/traffic/lanes.py": "",
        "dualpath/kv/layout.py": "",
    })
    found = {str(p.relative_to(tmp_path)) for p in pure_files(tmp_path)}
    assert found == {
        *REQUIRED_PURE, "dualpath/scheduler/__init__.py", "dualpath/scheduler/policy/select.py",
        "dualpath/traffic/lanes.py", "dualpath/kv/layout.py",
    }


def test_extra_check_flags_a_lazy_import_outside_the_extras_module(tmp_path):
    _write(tmp_path, {
        "dualpath/__init__.py": "",
        "dualpath/server/launch_ray.py": "import ray\n",
        "dualpath/server/serve.py": "def f():\n    from ray.exceptions import RayError\n",
    })
    assert extra_imports("ray", tmp_path) == ["dualpath/server/serve.py"]


def test_checker_flags_the_real_torch_backed_kv_cache():
    path = ROOT / "dualpath" / "kv" / "cache.py"
    violations = find_violations(path, is_forbidden_dependency)
    assert ["dualpath.kv.cache", "torch"] in violations


def test_cycle_check_names_the_modules_of_a_cycle_through_a_function_level_import(tmp_path):
    _write(tmp_path, {
        "dualpath/__init__.py": "",
        "dualpath/cli.py": "from dualpath.bench import run\n",
        "dualpath/bench.py": "from dualpath import report\nrun = 1\n",
        "dualpath/report.py": "def f():\n    from dualpath.cli import main\n",
        "dualpath/leaf.py": "from typing import TYPE_CHECKING\n"
                            "if TYPE_CHECKING:\n    from dualpath import cli\n",
    })
    assert import_cycles(import_graph(tmp_path)) == [
        ["dualpath.bench", "dualpath.report", "dualpath.cli", "dualpath.bench"]]
    _write(tmp_path, {"dualpath/report.py": "def f():\n    return 1\n"})
    assert import_cycles(import_graph(tmp_path)) == []  # a TYPE_CHECKING import is no edge


def test_argparse_check_flags_an_import_and_a_namespace_outside_the_cli(tmp_path):
    _write(tmp_path, {
        "dualpath/__init__.py": "",
        "dualpath/cli.py": "import argparse\ndef run(args: argparse.Namespace) -> int: ...\n",
        "dualpath/bench.py": "def run(options):\n    import argparse\n",
        "dualpath/sim.py": "from __future__ import annotations\n"
                           "def run(args: Namespace) -> None: ...\n",
        "dualpath/ok.py": "from typing import TYPE_CHECKING\nfrom types import SimpleNamespace\n"
                          "if TYPE_CHECKING:\n    from argparse import ArgumentParser\n"
                          "def add_arguments(parser: ArgumentParser, x: SimpleNamespace): ...\n",
    })
    assert argparse_users(tmp_path) == ["dualpath/bench.py: imports argparse",
                                        "dualpath/sim.py:2: annotated with Namespace"]



# --- packages: no two import each other; the engine imports no integration --------------------


def package_of(module: str, root: Path = ROOT) -> str | None:
    """The top-level package of a ``dualpath`` module (``dualpath.engine.loop`` -> ``engine``);
    None for a module at the top (``dualpath.vocab``), which any package may import."""
    parts = module.split(".")
    if len(parts) < 2 or (len(parts) == 2 and not (root / PKG / parts[1]).is_dir()):
        return None
    return parts[1]


def package_graph(graph: dict[str, list[str]], root: Path = ROOT) -> dict[str, list[str]]:
    """Each top-level package -> the other packages its modules import."""
    edges: dict[str, set[str]] = {}
    for module, targets in graph.items():
        source = package_of(module, root)
        if source is None:
            continue
        edges.setdefault(source, set())
        for target in targets:
            other = package_of(target, root)
            if other is not None and other != source:
                edges[source].add(other)
                edges.setdefault(other, set())
    return {name: sorted(targets) for name, targets in edges.items()}


def test_no_two_packages_import_each_other():
    """Each package sits above or below another, never both: an arrow back up (a decode worker
    of ``integrations`` reaching into ``engine``, which started it) is a loop to untie."""
    cycles = import_cycles(package_graph(import_graph()))
    assert not cycles, "package import loops:\n" + "\n".join(
        "  " + " -> ".join(cycle) for cycle in cycles)


ENGINE_FILES = sorted((ROOT / "dualpath" / "engine").rglob("*.py"))


def _is_integration(name: str) -> bool:
    return name == "dualpath.integrations" or name.startswith("dualpath.integrations.")


@pytest.mark.parametrize("path", ENGINE_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_engine_imports_no_integration(path):
    """The engine process runs any engine kind through the parts its command hands it
    (``commands/engine.py``); it imports no integration, directly or through another module."""
    violations = find_violations(path, _is_integration)
    assert not violations, "\n".join(
        [f"{path.relative_to(ROOT)} must not import dualpath.integrations, but:"]
        + ["  " + " -> ".join(chain) for chain in violations])


def test_the_package_checker_finds_a_loop_between_two_packages(tmp_path):
    _write(tmp_path, {
        "dualpath/__init__.py": "",
        "dualpath/vocab.py": "",
        "dualpath/a/__init__.py": "",
        "dualpath/a/x.py": "from dualpath.b import y\nfrom dualpath import vocab\n",
        "dualpath/b/__init__.py": "",
        "dualpath/b/y.py": "def f():\n    from dualpath.a import x\n",
    })
    graph = package_graph(import_graph(tmp_path), tmp_path)
    assert graph == {"a": ["b"], "b": ["a"]}  # vocab, at the top, is no package
    assert import_cycles(graph) == [["a", "b", "a"]]


# -- the one map of the tree (docs/design.md §8) --------------------------------------------------
def layout_table(text: str) -> dict[str, set[str]]:
    """The Layout table of design.md: package folder -> the module names its row backticks
    (outside parentheses, which hold notes)."""
    section = text.split("## 8. Layout", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, set[str]] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[0].startswith("`dualpath/"):
            named = re.sub(r"\([^)]*\)", "", cells[1])  # notes in parentheses name no module
            rows[cells[0].strip("`").rstrip("/")] = set(re.findall(r"`(\w+)`", named))
    return rows


def package_modules(root: Path = ROOT) -> dict[str, set[str]]:
    """Every package folder of the tree -> its modules (``.py`` files but ``__init__``)."""
    return {str(init.parent.relative_to(root)): {p.stem for p in init.parent.glob("*.py")
                                                 if p.stem != "__init__"}
            for init in (root / "dualpath").rglob("__init__.py")
            if "__pycache__" not in init.parts}


def layout_mismatches(table: dict[str, set[str]], tree: dict[str, set[str]]) -> list[str]:
    """What the table and the tree disagree on: missing or extra packages and modules."""
    out = [f"package {p} is not in the table" for p in sorted(tree.keys() - table.keys())]
    out += [f"the table lists {p}, which is no package" for p in sorted(table.keys() - tree.keys())]
    for package in sorted(tree.keys() & table.keys()):
        out += [f"{package}/{m}.py is not in its row"
                for m in sorted(tree[package] - table[package])]
        out += [f"{package}'s row names {m}, which is no module there"
                for m in sorted(table[package] - tree[package])]
    return out


def test_the_layout_table_names_every_module():
    table = layout_table((ROOT / "docs" / "design.md").read_text())
    assert len(table) >= 20
    assert layout_mismatches(table, package_modules()) == []


def test_the_layout_check_finds_a_module_missing_or_invented():
    table = layout_table("## 8. Layout\n| package | modules |\n|---|---|\n"
                         "| `dualpath/` | `cli` (the `table`), `vocab` |\n"
                         "| `dualpath/kv/` | `layout`, `gone` |\n"
                         "## 9. Next\n| `dualpath/x/` | `y` |")
    assert table == {"dualpath": {"cli", "vocab"}, "dualpath/kv": {"layout", "gone"}}
    tree = {"dualpath": {"cli", "vocab", "ending"}, "dualpath/kv": {"layout"},
            "dualpath/sim": {"events"}}
    assert layout_mismatches(table, tree) == [
        "package dualpath/sim is not in the table", "dualpath/ending.py is not in its row",
        "dualpath/kv's row names gone, which is no module there"]


def named_functions(text: str) -> list[tuple[str, str]]:
    """``(file, name)`` of every ```path.py: name, name``` cell of the request's life table
    (design.md §3): the functions the map names."""
    section = text.split("## 3. The request's life", 1)[1].split("\n## ", 1)[0]
    found = []
    for path, names in re.findall(r"`([\w/]+\.py): ([\w., ]+)`", section):
        found += [(path, name.strip()) for name in names.split(",") if name.strip()]
    return found


def missing_functions(found: list[tuple[str, str]], root: Path = ROOT) -> list[str]:
    """The named functions (or ``Class.method``) their file does not define."""
    missing = []
    for path, name in found:
        file = root / "dualpath" / path
        defined = set()
        if file.is_file():
            for node in ast.walk(ast.parse(file.read_text())):
                if isinstance(node, ast.ClassDef):
                    defined.add(node.name)
                    defined |= {f"{node.name}.{f.name}" for f in node.body
                                if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)}
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    defined.add(node.name)
        if name not in defined:
            missing.append(f"{path}: {name}")
    return missing


def test_the_request_life_names_functions_that_exist():
    found = named_functions((ROOT / "docs" / "design.md").read_text())
    assert len(found) >= 30
    assert missing_functions(found) == []
    assert missing_functions([("engine/prefill.py", "no_such_step"),
                              ("engine/no_such_file.py", "run")]) == [
        "engine/prefill.py: no_such_step", "engine/no_such_file.py: run"]
