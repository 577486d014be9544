"""The house's counts (issue 44), before and after: ``python tests/house_counts.py [ROOT]``.

Prefixed files in ``server/`` and ``integrations/``, ``getattr`` duck types in the engine loop,
the router state's inheritance ladder,
the lines of ``EngineProcess.__init__`` (with the vLLM branch's own method, if any), the places
that build a key space or derive an engine's KV dtype, the stop rule's and the EOS set's
statements, and the layout listings in the docs. (Package-level import loops:
``tests/test_layering.py``.)
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path


def prefixed(root: Path) -> int:
    """Files named ``api_*``/``router_*`` in server/, ``vllm_*`` in integrations/."""
    server = [p for p in (root / "dualpath/server").glob("*.py")
              if p.name.startswith(("api_", "router_"))]
    return len(server) + len(list((root / "dualpath/integrations").glob("vllm_*.py")))


def loop_getattrs(root: Path) -> int:
    return (root / "dualpath/engine/loop.py").read_text().count("getattr(")


def construction_lines(root: Path) -> int:
    """``EngineProcess.__init__`` and ``_init_vllm`` bodies, docstrings left out."""
    tree = ast.parse((root / "dualpath/engine/loop.py").read_text())
    total = 0
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == "EngineProcess":
            for f in node.body:
                if isinstance(f, ast.FunctionDef) and f.name in ("__init__", "_init_vllm"):
                    body = f.body[1:] if isinstance(f.body[0], ast.Expr) else f.body
                    total += body[-1].end_lineno - body[0].lineno + 1
    return total


def router_ladder(root: Path) -> int:
    """Classes of the router's state that inherit another (``class RouterX(RouterY)``); the
    callers' side (``client``, ``loop``) left out."""
    total = 0
    for path in (root / "dualpath/server").rglob("*.py"):
        if path.name in ("client.py", "loop.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                    isinstance(b, ast.Name) and b.id.startswith("Router") for b in node.bases):
                total += 1
    return total


def statements(root: Path, pattern: str, skip: tuple[str, ...] = ()) -> int:
    """Matches of ``pattern`` in dualpath/ (a rule's statements), files under ``skip`` left
    out (where the rule itself is defined)."""
    rx = re.compile(pattern)
    return sum(len(rx.findall(p.read_text())) for p in (root / "dualpath").rglob("*.py")
               if not str(p.relative_to(root)).startswith(skip))


def modules(root: Path, pattern: str) -> int:
    """Modules of dualpath/ with a match of ``pattern``."""
    rx = re.compile(pattern)
    return sum(bool(rx.search(p.read_text())) for p in (root / "dualpath").rglob("*.py"))


def layout_listings(root: Path) -> int:
    """Docs sections that list the package tree (README and docs/*.md)."""
    files = [root / "README.md", *(root / "docs").glob("*.md")]
    return sum(len(re.findall(r"^dualpath/\n|^\| `dualpath/` \|", f.read_text(), re.M))
               for f in files)


def main(root: Path) -> None:
    rows = {
        "prefixed files in server/ and integrations/": prefixed(root),
        "getattr duck types in engine/loop.py": loop_getattrs(root),
        "router-state classes inheriting another (the ladder)": router_ladder(root),
        "EngineProcess construction lines": construction_lines(root),
        "key spaces built outside kv/": statements(root, r"KeySpace\(", ("dualpath/kv/",)),
        "KV dtypes derived outside spec and layout": statements(
            root, r"resolve_kv_dtype\(", ("dualpath/model/spec.py", "dualpath/kv/layout.py")),
        "stop rules (EOS, then max_tokens)": statements(root, r"ignore_eos and "),
        "EOS sets (the tokenizer's added to the spec's)": statements(
            root, r"\.add\((?:token|self\.tokenizer\.eos_token_id|tokenizer_eos)\)"),
        "places that decide the read path": statements(root, r"def (?:read_plan|_choose_path)\("),
        "hit-block rules by read path outside kv/block_plan.py": statements(
            root, r"read_path *[!=]= *(?:ReadPath\.|\")|\{(?:ReadPath\.\w+|\"(?:pe|de|split)\"): |"
                  r"num_store_blocks <= b",
            ("dualpath/scheduler/", "dualpath/server/router/", "dualpath/sim/",
             "dualpath/vocab.py", "dualpath/kv/block_plan.py")),
        "modules stating the decode buffer's layer-major layout": modules(
            root, r"\(layer \* num_blocks \+ block\)|\(layer_idx \* len\(self\.pe_blocks\)|"
                  r"\.view\((?:layout|self\.layout)\.num_layers, n|"
                  r"return self\.num_layers, num_blocks"),
        "layout listings in the docs": layout_listings(root),
    }
    for name, value in rows.items():
        print(f"{value:5d}  {name}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1])
