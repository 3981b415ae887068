"""Layers point one way (front ends → loading → runtime → models → kernels / formats): no library module
imports the command line. Checked on the package's own imports, parsed from its sources."""

from __future__ import annotations

import ast
from pathlib import Path

import dflash_trt

PACKAGE = Path(dflash_trt.__file__).parent
FRONT_END = {"dflash_trt.cli"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: str, module: str, is_package: bool = False) -> set[str]:
    """Absolute names of the dflash_trt modules `module`'s source imports (relative imports resolved, lazy ones too)."""
    package = module.split(".") if is_package else module.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("dflash_trt")}
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            if module.startswith("dflash_trt"):
                found.add(module)
                found |= {f"{module}.{a.name}" for a in node.names}
    return found


def test_no_library_module_imports_the_command_line():
    offenders = {}
    for path in PACKAGE.rglob("*.py"):
        name = _module_name(path)
        if name in FRONT_END:
            continue
        bad = imported_modules(path.read_text(), name, path.name == "__init__.py") & FRONT_END
        if bad:
            offenders[name] = sorted(bad)
    assert offenders == {}


def test_the_import_scan_sees_lazy_relative_imports_of_the_cli():
    lazy = "def f():\n    from ..cli import DTYPES\n"
    assert "dflash_trt.cli" in imported_modules(lazy, "dflash_trt.serve.engine")
    assert "dflash_trt.cli" in imported_modules(lazy, "dflash_trt.serve", is_package=True)
    assert "dflash_trt.cli" in imported_modules("from . import cli\n", "dflash_trt.bench")
    assert imported_modules("from .loading import DTYPES\n", "dflash_trt.bench") == {"dflash_trt.loading", "dflash_trt.loading.DTYPES"}
