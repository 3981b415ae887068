"""Checkpoint reading: single and sharded safetensors, lazily; pickle refused; exact weight sets."""

import json

import pytest
import torch
from safetensors.torch import save_file

from dflash_trt.checkpoint import SafetensorsCheckpoint, atomic_directory
from dflash_trt.errors import CheckpointError


def _tensors():
    return {"a.weight": torch.randn(3, 4), "b.weight": torch.randn(5), "c.bias": torch.randn(2, 2)}


def test_sharded_index_reads_the_same_tensors_as_a_single_file(tmp_path):
    t = _tensors()
    single, sharded = tmp_path / "single", tmp_path / "sharded"
    single.mkdir(), sharded.mkdir()
    save_file(t, str(single / "model.safetensors"))
    save_file({"a.weight": t["a.weight"]}, str(sharded / "model-00001-of-00002.safetensors"))
    save_file({"b.weight": t["b.weight"], "c.bias": t["c.bias"]}, str(sharded / "model-00002-of-00002.safetensors"))
    index = {"a.weight": "model-00001-of-00002.safetensors", "b.weight": "model-00002-of-00002.safetensors", "c.bias": "model-00002-of-00002.safetensors"}
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    for d in (single, sharded):
        ck = SafetensorsCheckpoint(d)
        assert sorted(ck.keys()) == sorted(t)
        assert ck.shape("a.weight") == (3, 4)
        for name, tensor in t.items():
            assert torch.equal(ck.get(name), tensor)


def test_pickle_only_checkpoint_is_refused(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"not even read")
    with pytest.raises(CheckpointError, match="refusing.*pickle|pickle.*refusing"):
        SafetensorsCheckpoint(tmp_path)


def test_index_pointing_at_missing_shard_or_tensor_names_the_key(tmp_path):
    save_file({"a.weight": torch.zeros(1)}, str(tmp_path / "s1.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a.weight": "s1.safetensors", "b.weight": "s2.safetensors"}}))
    with pytest.raises(CheckpointError, match="weight_map.b.weight.*does not exist"):
        SafetensorsCheckpoint(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a.weight": "s1.safetensors", "b.weight": "s1.safetensors"}}))
    with pytest.raises(CheckpointError, match="weight_map.b.weight.*is not"):
        SafetensorsCheckpoint(tmp_path)


def test_load_exact_rejects_missing_extra_and_misshapen_tensors(tmp_path):
    save_file(_tensors(), str(tmp_path / "model.safetensors"))
    ck = SafetensorsCheckpoint(tmp_path)
    good = {"a.weight": (3, 4), "b.weight": (5,), "c.bias": (2, 2)}
    assert set(ck.load_exact(good)) == set(good)
    with pytest.raises(CheckpointError, match="d.weight: required tensor is missing"):
        ck.load_exact({**good, "d.weight": (1,)})
    with pytest.raises(CheckpointError, match="c.bias: unexpected tensor"):
        ck.load_exact({"a.weight": (3, 4), "b.weight": (5,)})
    with pytest.raises(CheckpointError, match=r"a.weight: shape \[3, 4\] != expected \[4, 3\]"):
        ck.load_exact({**good, "a.weight": (4, 3)})


def test_atomic_directory_leaves_nothing_on_failure_and_renames_on_success(tmp_path):
    dest = tmp_path / "out"
    with pytest.raises(RuntimeError):
        with atomic_directory(dest) as tmp:
            (tmp / "half.json").write_text("{}")
            raise RuntimeError("boom")
    assert not dest.exists() and list(tmp_path.iterdir()) == []
    with atomic_directory(dest) as tmp:
        (tmp / "done.json").write_text("{}")
    assert (dest / "done.json").is_file() and len(list(tmp_path.iterdir())) == 1
    with pytest.raises(FileExistsError):
        with atomic_directory(dest):
            pass
