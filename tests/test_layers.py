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
    "format": set(),
    "config": {"kernels"},  # precision.kernel's allowed names come from the backend registry
    "kernels": {"format"},
    "nn": {"format", "kernels", "config"},
    "zero": {"format", "kernels", "nn", "config"},
    "checkpoint": {"config"},
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
            if other != me and other not in ALLOWED[me]:
                wrong.append(f"{path.relative_to(ROOT)} ({me}) imports {target} ({other})")
    assert wrong == [], "\n".join(wrong)


def test_import_ds_nvfp4_loads_no_evaluation_tooling() -> None:
    code = ("import json, sys, ds_nvfp4; print(json.dumps(sorted(m for m in sys.modules if m.startswith("
            "('ds_nvfp4.evaluation', 'ds_nvfp4.cli', 'ds_nvfp4.export', 'deepspeed', 'matplotlib')))))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == []


def test_runtime_files_fit_on_a_few_screens() -> None:
    """The runtime package (everything but the evaluation tooling and the CLI) has no file above ~400 lines."""
    long = [f"{p.relative_to(ROOT)}: {n} lines" for p in PKG.rglob("*.py")
            if "evaluation" not in p.parts and "cli" not in p.parts
            and (n := len(p.read_text().splitlines())) > 420]
    assert long == [], long
