"""Layers point one way (front ends → loading → runtime → models → kernels / formats): no library module
imports the command line, and no module reaches itself through the modules it imports (an import under
`if TYPE_CHECKING:` runs only for type checkers and does not count). Checked on the package's own imports,
parsed from its sources."""

from __future__ import annotations

import ast
from pathlib import Path

import dflash_trt

PACKAGE = Path(dflash_trt.__file__).parent
FRONT_END = {"dflash_trt.cli"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_only(tree: ast.AST) -> set[int]:
    """ids of the import nodes under `if TYPE_CHECKING:` (or `typing.TYPE_CHECKING`)."""
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and (getattr(node.test, "id", None) == "TYPE_CHECKING" or getattr(node.test, "attr", None) == "TYPE_CHECKING"):
            skipped |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return skipped


def imported_modules(source: str, module: str, is_package: bool = False) -> set[str]:
    """Absolute names of the dflash_trt modules `module`'s source imports (relative imports resolved, lazy ones too;
    type-checking-only ones left out)."""
    package = module.split(".") if is_package else module.split(".")[:-1]
    found = set()
    tree = ast.parse(source)
    skipped = _type_checking_only(tree)
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
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


def import_graph() -> dict[str, set[str]]:
    """module → the package modules it imports (a `from m import name` counts as importing m, or m.name when that
    is a module)."""
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in paths.items():
        deps = set()
        for m in imported_modules(path.read_text(), name, path.name == "__init__.py"):
            while m not in paths and "." in m:
                m = m.rsplit(".", 1)[0]
            if m in paths and m not in (name, "dflash_trt"):
                deps.add(m)
        graph[name] = deps
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circles():
    assert circles(import_graph()) == []


def test_the_circle_finder_finds_a_circle_and_skips_type_checking_imports():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []
    guarded = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .tp import TPGroup\nfrom .errors import X\n"
    assert imported_modules(guarded, "dflash_trt.torch_backend") == {"dflash_trt.errors", "dflash_trt.errors.X"}


# The layers, top to bottom, listed once (docs/architecture.md draws them). A module belongs to the layer of its
# longest listed prefix; a package's modules go with it unless listed themselves.
LAYERS = [
    ("front ends", ["cli", "bench", "peers", "plan", "convert", "deploy", "serve", "trtllm.build_config", "trtllm.engine_build", "trtllm.emulation_check"]),
    ("loading", ["loading", "quant.calibrate"]),
    ("runtime", ["runtime", "speculative", "torch_backend", "tp", "draft_length", "sampling", "trtllm.emulation", "trtllm.executor"]),
    ("models and kernels", ["models", "kernels", "kv_cache", "trtllm.model", "trtllm.engine_network", "trtllm.network", "trtllm.plugin_library"]),
    ("formats", ["config", "trtllm_config", "speculators_format", "checkpoint_formats", "checkpoint", "safetensors_io", "quant", "prompts", "fetch", "cost_model", "presets"]),
    ("base", ["errors", "flags", "shard_rules", "tree", "progress", "trtllm.api", "trtllm.contract", "trtllm", "dflash_trt"]),
]
MAX_UPWARD = 0  # issue 16 allows 2; there are none


def layer_of(module: str) -> int | None:
    short = module if module == "dflash_trt" else module.removeprefix("dflash_trt.")
    best = None
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (short == prefix or short.startswith(prefix + ".")) and (best is None or len(prefix) > best[1]):
                best = (i, len(prefix))
    return None if best is None else best[0]


def test_every_module_has_a_layer_and_imports_point_down():
    graph = import_graph()
    assert [m for m in graph if layer_of(m) is None] == []
    upward = sorted(f"{m} -> {d}" for m, deps in graph.items() for d in deps if layer_of(d) < layer_of(m))
    assert len(upward) <= MAX_UPWARD, upward
