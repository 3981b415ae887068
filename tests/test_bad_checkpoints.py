"""Damaged checkpoints (issue 20 item 3): every case gives one error line naming the file (and the key where there
is one) with exit code 2, from `generate` (loading) and from `convert` (which then leaves nothing written). The
cases are built from the tiny random pair; the count is printed (`-s`)."""

from __future__ import annotations

import json
import os
import shutil
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_trt.cli import main


def _header(path):
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _write_header(path, header, data):
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)


def _first_weight(header):
    return next(k for k, v in header.items() if k != "__metadata__" and len(v["shape"]) == 2)


def truncate(d):
    p = d / "model.safetensors"
    p.write_bytes(p.read_bytes()[:-4096])
    return "model.safetensors", "truncated"


def lying_offsets(d):
    p = d / "model.safetensors"
    h, data = _header(p)
    k = _first_weight(h)
    a, b = h[k]["data_offsets"]
    h[k]["data_offsets"] = [a, b + 8]
    _write_header(p, h, data)
    return "model.safetensors", "data_offsets"


def lying_dtype(d):
    p = d / "model.safetensors"
    h, data = _header(p)
    k = _first_weight(h)
    h[k]["dtype"] = "F64" if h[k]["dtype"] == "F32" else "F32"
    _write_header(p, h, data)
    return "model.safetensors", k


def unknown_dtype(d):
    p = d / "model.safetensors"
    h, data = _header(p)
    k = _first_weight(h)
    h[k]["dtype"] = "Q7"
    _write_header(p, h, data)
    return "model.safetensors", k


def header_not_json(d):
    p = d / "model.safetensors"
    raw = p.read_bytes()
    p.write_bytes(raw[:8] + b"{" * 8 + raw[16:])
    return "model.safetensors", "header"


def _poison(d, pick, value):
    """Write `value` into the first tensor `pick` selects; returns where the error must point."""
    p = d / "model.safetensors"
    state = load_file(p)
    k = next(k for k, v in state.items() if pick(k, v))
    state[k].view(-1)[0] = value
    save_file(state, p)
    return "model.safetensors", k


def nan_weight(d):
    return _poison(d, lambda k, v: v.dim() == 2 and "layers.0" in k, float("nan"))


def inf_weight(d):
    return _poison(d, lambda k, v: v.dim() == 1 and "norm" in k, float("inf"))


def wrong_shape(d):
    p = d / "model.safetensors"
    state = load_file(p)
    k = next(k for k, v in state.items() if v.dim() == 2 and "layers.0" in k)
    state[k] = state[k][:, :-1].contiguous()
    save_file(state, p)
    return "model.safetensors", k


def missing_tensor(d):
    p = d / "model.safetensors"
    state = load_file(p)
    k = next(k for k in state if "layers.0" in k)
    del state[k]
    save_file(state, p)
    return "", k


def extra_tensor(d):
    p = d / "model.safetensors"
    state = load_file(p)
    state["layers.0.self_attn.surprise.weight"] = torch.zeros(2, 2)
    save_file(state, p)
    return "", "layers.0.self_attn.surprise.weight"


def config_wrong_type(d):
    p = d / "config.json"
    raw = json.loads(p.read_text())
    raw["num_hidden_layers"] = "two"
    p.write_text(json.dumps(raw))
    return "config.json", "num_hidden_layers"


def config_negative(d):
    p = d / "config.json"
    raw = json.loads(p.read_text())
    raw["num_attention_heads"] = -4
    p.write_text(json.dumps(raw))
    return "config.json", "num_attention_heads"


def config_not_object(d):
    (d / "config.json").write_text("[1, 2, 3]")
    return "config.json", ""


def config_symlink_loop(d):
    (d / "config.json").unlink()
    os.symlink(d / "loop.json", d / "config.json")
    os.symlink(d / "config.json", d / "loop.json")
    return "config.json", ""


def weights_symlink_loop(d):
    (d / "model.safetensors").unlink()
    os.symlink(d / "loop.safetensors", d / "model.safetensors")
    os.symlink(d / "model.safetensors", d / "loop.safetensors")
    return "safetensors", "symbolic links"  # either link of the loop may be the one named


def d2t_out_of_range(d):
    p = d / "config.json"
    raw = json.loads(p.read_text())
    raw["draft_vocab_size"] = 8
    p.write_text(json.dumps(raw))
    state = load_file(d / "model.safetensors")
    state["d2t"] = torch.tensor([0, 0, 0, 10**6, 0, 0, 0, 0])
    save_file(state, d / "model.safetensors")
    return "", "d2t"


DRAFTER_CASES = [truncate, lying_offsets, lying_dtype, unknown_dtype, header_not_json, nan_weight, inf_weight, wrong_shape, missing_tensor,
                 extra_tensor, config_wrong_type, config_negative, config_not_object, config_symlink_loop, weights_symlink_loop, d2t_out_of_range]
TARGET_CASES = [truncate, lying_offsets, nan_weight, wrong_shape, config_wrong_type, config_symlink_loop]


def _damaged(src, tmp_path, case):
    d = tmp_path / "damaged"
    shutil.copytree(src, d)
    return d, case(d)


def _check(err: str, d, where):
    fname, key = where
    assert err.count("\n") == 1 and err.startswith("error: "), err
    assert str(d) in err, err
    if fname:
        assert fname in err, err
    if key:
        assert key in err, err


@pytest.mark.parametrize("case", DRAFTER_CASES, ids=lambda c: c.__name__)
def test_a_damaged_drafter_is_one_error_naming_file_and_key(tiny_dirs, tmp_path, capsys, case):
    target, drafter = tiny_dirs
    d, where = _damaged(drafter, tmp_path, case)
    assert main(["generate", "--target", str(target), "--drafter", str(d), "--prompt", "x", "--max-new-tokens", "2"]) == 2
    _check(capsys.readouterr().err, d, where)
    # convert refuses it too, and leaves nothing behind
    out = tmp_path / "out"
    assert main(["convert", "--target", str(target), "--drafter", str(d), "--out", str(out), "--dtype", "fp32", "--quiet"]) == 2
    _check(capsys.readouterr().err, d, where)
    assert not out.exists() and not list(tmp_path.glob(".out.tmp-*"))


@pytest.mark.parametrize("case", TARGET_CASES, ids=lambda c: c.__name__)
def test_a_damaged_target_is_one_error_naming_file_and_key(tiny_dirs, tmp_path, capsys, case):
    target, _ = tiny_dirs
    d, where = _damaged(target, tmp_path, case)
    assert main(["generate", "--target", str(d), "--no-drafter", "--tokenizer", str(target), "--prompt", "x", "--max-new-tokens", "2"]) == 2
    _check(capsys.readouterr().err, d, where)


def test_case_count():
    print(f"\n{len(DRAFTER_CASES)} drafter cases x (generate, convert) + {len(TARGET_CASES)} target cases = "
          f"{2 * len(DRAFTER_CASES) + len(TARGET_CASES)} checks")
    assert len(DRAFTER_CASES) >= 15
