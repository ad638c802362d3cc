"""The package's layers import only downward, and the evaluation tooling stays off the runtime's import path."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "ds_nvfp4"

#: which parts of ds_nvfp4 each part may import (docs/architecture.md): format <- kernels <- nn <- zero <- engine,
#: with config, checkpoint, export and envcheck beside them; cli and evaluation on top
ALLOWED = {
    "_version": set(),  # a leaf: every part may import it
    "format": set(),
    "config": {"format", "kernels"},  # kernel names come from the backend registry; WeightScaling from format
    "kernels": {"format"},
    "nn": {"format", "kernels", "config"},
    "zero": {"format", "kernels", "nn", "config"},
    "checkpoint": {"format", "config"},
    "engine": {"format", "kernels", "nn", "zero", "config", "checkpoint", "__init__"},
    "export": {"format", "nn", "checkpoint", "config", "__init__"},
    "envcheck": {"format", "kernels", "config", "zero"},
    "__init__": {"format", "config", "nn", "engine"},
    "__main__": {"cli"},
    "evaluation": {"format", "kernels", "nn", "zero", "config", "checkpoint", "engine", "__init__", "evaluation"},
    "cli": {"format", "kernels", "nn", "zero", "config", "checkpoint", "engine", "export", "envcheck", "evaluation",
            "__init__", "cli"},
}


def part_of(module: str) -> str:
    """``ds_nvfp4.nn.linear`` -> ``nn``; ``ds_nvfp4`` -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imports(path: Path) -> set[str]:
    """Every ds_nvfp4 module ``path`` imports (top level or inside functions), absolute."""
    here = list(path.relative_to(ROOT).with_suffix("").parts[:-1])  # the package holding the file
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
                if not node.module:  # "from . import x": x is a submodule or a name of the package
                    out |= {f"{name}.{a.name}" if _is_module(f"{name}.{a.name}") else name for a in node.names}
                    continue
            else:
                name = node.module or ""
            out.add(name)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return {m for m in out if m == "ds_nvfp4" or m.startswith("ds_nvfp4.")}


def _is_module(dotted: str) -> bool:
    path = ROOT.joinpath(*dotted.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def test_each_part_imports_only_what_it_may() -> None:
    wrong = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        me = part_of(".".join(p for p in rel.parts if p != "__init__"))
        for target in imports(path):
            other = part_of(target)
            if other not in (me, "_version") and other not in ALLOWED[me]:
                wrong.append(f"{path.relative_to(ROOT)} ({me}) imports {target} ({other})")
    assert wrong == [], "\n".join(wrong)


def test_import_ds_nvfp4_loads_no_evaluation_tooling() -> None:
    code = ("import json, sys, ds_nvfp4; print(json.dumps(sorted(m for m in sys.modules if m.startswith("
            "('ds_nvfp4.evaluation', 'ds_nvfp4.cli', 'ds_nvfp4.export', 'deepspeed', 'matplotlib')))))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == []


def test_runtime_files_fit_on_a_few_screens() -> None:
    """Every runtime file (all of ds_nvfp4 but the evaluation tooling, the CLI included) and the start-up hook has at
    most 400 lines."""
    files = [p for p in PKG.rglob("*.py") if "evaluation" not in p.parts] + [ROOT / "ds_nvfp4_autohook.py"]
    long = [f"{p.relative_to(ROOT)}: {n} lines" for p in files if (n := len(p.read_text().splitlines())) > 400]
    assert long == [], long


def test_the_start_up_hook_imports_only_the_standard_library_and_the_entry_point() -> None:
    """ds_nvfp4_autohook runs at every interpreter start (its .pth file): at import it may load only modules the
    interpreter has already loaded, and of ds_nvfp4 it calls only the package's ``initialize``."""
    path = ROOT / "ds_nvfp4_autohook.py"
    tree = ast.parse(path.read_text())
    top = {a.name for node in tree.body if isinstance(node, ast.Import) for a in node.names}
    top |= {node.module for node in tree.body if isinstance(node, ast.ImportFrom) and node.module != "__future__"}
    assert top <= {"os", "sys"}, top
    assert imports(path) == {"ds_nvfp4"}


def runtime_imports(path: Path) -> set[str]:
    """The ds_nvfp4 modules ``path`` can import when it runs (inside functions too; ``if TYPE_CHECKING:`` blocks
    aside), absolute; ``from pkg import name`` counts as importing ``pkg.name`` when that is a module."""
    here = list(path.relative_to(ROOT).with_suffix("").parts[:-1])
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.ImportFrom):
                base = ".".join(here[: len(here) - child.level + 1]) if child.level else ""
                name = ".".join(x for x in (base, child.module) if x)
                out.update(f"{name}.{a.name}" if _is_module(f"{name}.{a.name}") else name for a in child.names)
            elif isinstance(child, ast.Import):
                out.update(a.name for a in child.names)
            visit(child)

    visit(ast.parse(path.read_text()))
    return {m for m in out if m == "ds_nvfp4" or m.startswith("ds_nvfp4.")}


def test_no_import_circle_in_the_runtime() -> None:
    """No chain of imports leads from a ds_nvfp4 module back to itself, counting the implicit import of every package
    on the way (importing ``a.b.c`` runs ``a/b/__init__.py``) and imports inside functions: a circle makes the import
    order matter and breaks the first file that imports at the top what it used to import lazily."""
    graph: dict[str, set[str]] = {}
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(ROOT).with_suffix("")
        me = ".".join(p for p in rel.parts if p != "__init__")
        mine = {me.rsplit(".", i)[0] for i in range(1, me.count(".") + 1)}  # my packages (being imported)
        targets = set()
        for t in runtime_imports(path):  # a name read from a package of mine (``from .. import x``) counts
            targets |= {t} | ({t.rsplit(".", i)[0] for i in range(1, t.count(".") + 1)} - mine)
        graph[me] = targets - {me}
    cycles = _cycles(graph)
    assert cycles == [], "\n".join("import circle among: " + ", ".join(c) for c in cycles)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The modules of each import circle (a strongly connected component of more than one module; iterative
    Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found
