"""DFlashForCausalLM's tensorrt_llm network (dflash_trt/trtllm/engine_network.py) cannot run here (no tensorrt_llm).
What can be checked on CPU is checked: every upstream callable it calls is cited in api_snapshot.json with its
parameters, and every call passes only parameters that signature has (an AST scan: a misspelt keyword, or one the
1.2.x signature lacks, fails here instead of inside trtllm-build); the inputs it declares are the contract's plus
the stock EAGLE plugins' (all bound by the runtime); its constant tensors equal the contract's."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

from dflash_trt.trtllm import api, contract, engine_network

SOURCE = Path(engine_network.__file__)
# instance attributes the network calls, and the class whose method that call is (attribute = an instance of it)
INSTANCE_CALLS = {"attention": "Attention.forward"}


def _api_bindings(tree: ast.AST) -> dict[str, str]:
    """Local name → api short name, from `x = api.get("X")` and `a, b = api.get("A"), api.get("B")`."""
    def short(node):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "api" and isinstance(node.args[0], ast.Constant):
            return node.args[0].value
        return None

    out = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Assign) or len(node.targets) != 1:
            continue
        target, value = node.targets[0], node.value
        pairs = zip(target.elts, value.elts) if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) else [(target, value)]
        for t, v in pairs:
            if isinstance(t, ast.Name) and short(v):
                out[t.id] = short(v)
    return out


def _calls(tree: ast.AST, bindings: dict[str, str]):
    """(lineno, snapshot key, positional count, keyword names) of every call of an upstream callable."""
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f, key = node.func, None
        if isinstance(f, ast.Name) and f.id in bindings:
            key = api.NAMES[bindings[f.id]]
        elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in bindings:
            key = f"{api.NAMES[bindings[f.value.id]]}.{f.attr}"
        elif isinstance(f, ast.Attribute) and f.attr in INSTANCE_CALLS:
            cls, _, method = INSTANCE_CALLS[f.attr].partition(".")
            key = f"{api.NAMES[cls]}.{method}"
        if key is not None:
            yield node.lineno, key, len(node.args), [k.arg for k in node.keywords if k.arg is not None]


def signature_problems(source: str) -> list[str]:
    tree = ast.parse(source)
    snap = api.snapshot()["names"]
    problems = []
    for line, key, npos, kws in _calls(tree, _api_bindings(tree)):
        entry = snap.get(key)
        if entry is None or entry.get("params") is None:
            problems.append(f"{line}: {key} has no parameter list in api_snapshot.json")
            continue
        params = entry["params"]
        names = {p.lstrip("*") for p in params}
        if "**kwargs" not in params:
            problems += [f"{line}: {key} has no parameter {k!r} ({entry['file']}:{entry['line']})" for k in kws if k not in names]
        positional = [p for p in params if not p.startswith("*")]
        if "*args" not in params and npos > len(positional):
            problems.append(f"{line}: {key} takes {len(positional)} positional arguments, {npos} given")
    return problems


def test_every_upstream_call_passes_only_parameters_its_cited_signature_has():
    source = SOURCE.read_text()
    bindings = _api_bindings(ast.parse(source))
    assert {"Attention", "eagle_sample_and_accept_draft_plugin", "eagle_prepare_drafter_inputs_plugin", "Tensor"} <= set(bindings.values())
    assert len(list(_calls(ast.parse(source), bindings))) > 40
    assert signature_problems(source) == []


def test_the_scan_notices_a_wrong_keyword_and_too_many_positionals():
    source = SOURCE.read_text()
    assert "num_kv_heads=cfg" in source and "unsqueeze(batch, 0)" in source
    wrong_kw = source.replace("num_kv_heads=cfg", "num_key_value_heads=cfg", 1)
    assert any("no parameter 'num_key_value_heads'" in p for p in signature_problems(wrong_kw))
    extra_positional = source.replace("unsqueeze(batch, 0)", "unsqueeze(batch, 0, 1)", 1)
    assert any("positional arguments, 3 given" in p for p in signature_problems(extra_positional))


def _declared_inputs() -> set[str]:
    """The string constants of prepare_inputs that name runtime-bound EAGLE inputs (what it declares)."""
    tree = ast.parse(SOURCE.read_text())
    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "prepare_inputs")
    strings = {n.value for n in ast.walk(fn) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    return strings & contract.EAGLE_RUNTIME_INPUTS


def test_declared_inputs_are_the_contracts_plus_the_stock_plugins_and_the_runtime_binds_them_all():
    declared = _declared_inputs()
    spec = {"spec_decoding_generation_lengths", "spec_decoding_position_offsets", "spec_decoding_packed_mask"}  # the base declares them
    expected = (set(contract.INPUT_NAMES) | set(engine_network.STOCK_PLUGIN_INPUTS)) - contract.BASE_INPUTS - spec \
        - set(engine_network.UNREAD_CONTRACT_INPUTS)
    assert declared == expected
    assert set(engine_network.STOCK_PLUGIN_INPUTS) <= contract.EAGLE_RUNTIME_INPUTS
    # forward takes every declared input out of the base model's kwargs (draft_paths travels as tree_params)
    tree = ast.parse(SOURCE.read_text())
    fwd = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "forward" and
               any(isinstance(c, ast.Constant) and c.value == "tree_params" for c in ast.walk(n)))
    popped = {n.value for n in ast.walk(fwd) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    assert (declared - {"draft_paths"}) | {"tree_params"} <= popped


def _bits(words: np.ndarray, n: int) -> np.ndarray:
    """[rows, n] bool from packed int32 words (bit j of row i = word j // 32, bit j % 32)."""
    u = words.astype(np.int64) & 0xFFFFFFFF
    return np.array([[(row[j // 32] >> (j % 32)) & 1 for j in range(n)] for row in u], dtype=bool)


@pytest.mark.parametrize("k", [1, 3, 15, 31, 40])
def test_the_networks_constants_are_the_contracts(k):
    dims = contract.Dims(k + 1)
    paths = engine_network.chain_paths_array(k)  # closed form: path 0 = 0..K, every other entry -1
    assert paths.shape == (k + 1, k + 1) and paths.dtype == np.int32
    assert paths[0].tolist() == list(range(k + 1)) and (paths[1:] == -1).all()
    mask = engine_network.block_packed_mask_array(k)
    assert mask.shape == (k + 1, dims.packed_mask_words) and mask.dtype == np.int32
    assert _bits(mask, 32 * mask.shape[1]).sum(1).tolist() == [k + 1] * (k + 1)  # every row: exactly the block's K+1 bits
    assert _bits(mask, k + 1).all()
    # the chain's causal mask (what the target verify uses) is the lower triangle of the same encoding
    causal = contract.chain_packed_mask(dims, 1)[0].numpy()
    assert np.array_equal(_bits(causal, k + 1), np.tril(np.ones((k + 1, k + 1), dtype=bool)))


def test_the_gpu_checks_build_uses_only_trtllm_build_flags_of_the_snapshot():
    import re

    script = (Path(__file__).parents[1] / "scripts" / "gpu_engine_check.sh").read_text()
    build = script[script.index("python -m dflash_trt.trtllm.engine_build"):]
    build = build[: build.index("\n\n")]
    flags = set(re.findall(r"(--[a-z_]+)", build))
    assert {"--speculative_decoding_mode", "--max_draft_len", "--checkpoint_dir"} <= flags
    assert flags <= set(api.snapshot()["trtllm_build_flags"]["flags"]), flags - set(api.snapshot()["trtllm_build_flags"]["flags"])
