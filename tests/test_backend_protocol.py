"""The Backend protocol (speculative.py) lists every member the loop, the Generator and the server (serve/*.py)
use on a backend, and each backend implements every member of the protocol with its signature."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import dflash_trt
from dflash_trt.speculative import Backend
from dflash_trt.torch_backend import TorchBackend

PACKAGE = Path(dflash_trt.__file__).parent
# The modules that drive any backend through the protocol (backend-specific code may reach further, through
# getattr with a default, as serve/engine.py's free_kv_pages does).
LOOP_MODULES = ("speculative.py", "runtime.py", *sorted(str(p.relative_to(PACKAGE)) for p in (PACKAGE / "serve").glob("*.py")))


def _protocol_members() -> set[str]:
    methods = {n for n, v in vars(Backend).items() if not n.startswith("_") and callable(v)}
    return methods | set(Backend.__annotations__)


def _used_on_backend(source: str) -> set[str]:
    """Attribute names read on `backend` or on any `<name>.backend` (`self.backend`, `gen.backend`) in a module."""
    used = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute):
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id == "backend":
                used.add(node.attr)
            elif isinstance(owner, ast.Attribute) and owner.attr == "backend" and isinstance(owner.value, ast.Name):
                used.add(node.attr)
    return used


def test_every_member_the_loop_uses_is_in_the_protocol():
    used = set().union(*(_used_on_backend((PACKAGE / m).read_text()) for m in LOOP_MODULES))
    assert {"pages_needed", "num_pages", "verify", "commit"} <= used  # the scan sees what it should
    assert any(m.startswith("serve/") for m in LOOP_MODULES)  # and reads the server's modules
    assert used <= _protocol_members(), sorted(used - _protocol_members())


def test_the_scan_notices_a_member_missing_from_the_protocol():
    assert "evict" in _used_on_backend("def f(self):\n    self.backend.evict(3)\n") - _protocol_members()
    assert "evict" in _used_on_backend("def f(gen):\n    gen.backend.evict(3)\n") - _protocol_members()


def test_backends_implement_the_protocol_with_its_signatures(tiny_dirs):
    from dflash_trt.loading import load_torch_backend

    target_dir, drafter_dir = tiny_dirs
    backend = load_torch_backend(target_dir, drafter_dir)
    methods = {n for n, v in vars(Backend).items() if not n.startswith("_") and callable(v)}
    for name in _protocol_members():
        assert hasattr(backend, name), name
    for cls in (TorchBackend,):
        for name in methods:
            impl = getattr(cls, name, None)
            assert impl is not None, f"{cls.__name__}.{name}"
            assert list(inspect.signature(impl).parameters) == list(inspect.signature(getattr(Backend, name)).parameters), f"{cls.__name__}.{name}"
