"""Tiny random checkpoints in the real Hugging Face formats, written by transformers (targets) and in
z-lab's released layout (drafters), plus a tiny tokenizer with a chat template."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

# Triton kernels run in its interpreter on CPU. The variable is read when triton is first imported, and
# other tests' imports (modelopt, torch's own) may get there first: set it before any test module loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from dflash_trt.config import load_drafter_config, load_target_config
from dflash_trt.models.drafter import DFlashDrafter

# Step-cost calibrations of the tests' random models go to a scratch directory, not the user's cache.
if "DFLASH_TRT_CALIBRATION" not in os.environ:
    import tempfile

    os.environ["DFLASH_TRT_CALIBRATION"] = tempfile.mkdtemp(prefix="dflash-trt-calibration-")

# One thread: tiny models gain nothing from more, and OpenMP spin-waits badly when cores are shared.
torch.set_num_threads(1)

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, vocab_size=96)


def _perturb_norms(state: dict[str, torch.Tensor], gen: torch.Generator) -> None:
    # Norm weights are ones at init; perturb them so a misplaced norm changes the output.
    for name, t in state.items():
        if "norm" in name:
            t.copy_(1 + 0.2 * torch.randn(t.shape, generator=gen))


def write_target(path: Path, arch: str = "llama", seed: int = 0, tie: bool = False, **overrides) -> Path:
    """A randomly initialised LlamaForCausalLM / Qwen3ForCausalLM saved by transformers."""
    import transformers

    kwargs = dict(TINY, max_position_embeddings=512, initializer_range=0.15, tie_word_embeddings=tie, rms_norm_eps=1e-6)
    kwargs.update(overrides)
    kwargs.setdefault("eos_token_id", 2)
    kwargs.setdefault("bos_token_id", 1)
    if arch == "llama":
        cfg = transformers.LlamaConfig(**kwargs)
        cls = transformers.LlamaForCausalLM
    else:
        kwargs.setdefault("head_dim", 24)
        cfg = transformers.Qwen3Config(**kwargs)
        cls = transformers.Qwen3ForCausalLM
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        _perturb_norms(dict(model.named_parameters()), gen)
    model.save_pretrained(path, safe_serialization=True)
    return path


def write_drafter(
    path: Path,
    target_dir: Path,
    num_layers: int = 2,
    block_size: int = 16,
    seed: int = 0,
    block_size_in_dflash_config: bool = False,
    target_layer_ids: list[int] | None = None,
    layer_types: list[str] | None = None,
    sliding_window: int | None = None,
    mask_token_id: int = 3,
    extra: dict | None = None,
    **overrides,
) -> Path:
    """A random DFlash drafter in z-lab's released format (config.json + model.safetensors)."""
    target_raw = json.loads((target_dir / "config.json").read_text())
    n_target = target_raw["num_hidden_layers"]
    dflash = {"mask_token_id": mask_token_id}
    if target_layer_ids is not None:
        dflash["target_layer_ids"] = target_layer_ids
    raw = {
        "architectures": ["DFlashDraftModel"],
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3",
        "hidden_size": target_raw["hidden_size"],
        "intermediate_size": 96,
        "num_hidden_layers": num_layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": target_raw["vocab_size"],
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 512,
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": False,
        "num_target_layers": n_target,
        "dflash_config": dflash,
        "layer_types": layer_types or ["full_attention"] * num_layers,
        "use_sliding_window": sliding_window is not None,
        "sliding_window": sliding_window,
    }
    if block_size_in_dflash_config:
        dflash["block_size"] = block_size
    else:
        raw["block_size"] = block_size
    raw.update(overrides)
    raw.update(extra or {})
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(raw, indent=2))
    cfg = load_drafter_config(path)
    from dflash_trt.config import check_pair

    cfg = check_pair(load_target_config(target_dir), cfg)
    torch.manual_seed(seed + 100)
    model = DFlashDrafter(cfg, len(cfg.target_layer_ids) * target_raw["hidden_size"])
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    gen = torch.Generator().manual_seed(seed + 101)
    for name, t in state.items():
        if "norm" in name:
            t.copy_(1 + 0.2 * torch.randn(t.shape, generator=gen))
        elif t.dim() == 2:
            t.copy_(0.15 * torch.randn(t.shape, generator=gen))
    save_file(state, str(path / "model.safetensors"))
    return path


def write_tokenizer(path: Path, vocab_size: int) -> Path:
    """A byte-level BPE of exactly `vocab_size` tokens with ChatML specials and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|pad|>", "<|bos|>", "<|im_end|>", "<|mask|>", "<|im_start|>"]  # ids 0..4 (eos = 2, mask = 3)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, initial_alphabet=[], show_progress=False)
    text = ["def add(a, b):\n    return a + b\n", "The quick brown fox jumps over the lazy dog.", "hello world " * 3]
    tok.train_from_iterator(text * 20, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|im_end|>", pad_token="<|pad|>",
    )
    fast.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    fast.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """One shared Llama target (with tokenizer) + drafter, for tests that only read them."""
    root = tmp_path_factory.mktemp("tiny")
    target = write_target(root / "target", "llama", seed=0)
    write_tokenizer(target, TINY["vocab_size"])
    drafter = write_drafter(root / "drafter", target, num_layers=2, block_size=8)
    return target, drafter


def write_eagle(path: Path, target_dir: Path, block_size: int = 8, seed: int = 0, target_layer_ids=(0, 1, 3)) -> Path:
    """A random EAGLE-3-style baseline drafter in our format."""
    from dflash_trt.config import EAGLE_ARCHITECTURE, check_pair, load_eagle_config
    from dflash_trt.models.eagle import Eagle3Drafter

    target_raw = json.loads((target_dir / "config.json").read_text())
    raw = {
        "architectures": [EAGLE_ARCHITECTURE], "block_size": block_size, "dflash_config": {"target_layer_ids": list(target_layer_ids)},
        "num_target_layers": target_raw["num_hidden_layers"], "hidden_size": target_raw["hidden_size"], "intermediate_size": 96,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "vocab_size": target_raw["vocab_size"], "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 512, "hidden_act": "silu",
    }
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(raw, indent=2))
    cfg = check_pair(load_target_config(target_dir), load_eagle_config(path))
    torch.manual_seed(seed + 200)
    model = Eagle3Drafter(cfg, len(cfg.target_layer_ids) * target_raw["hidden_size"])
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    gen = torch.Generator().manual_seed(seed + 201)
    for name, t in state.items():
        t.copy_(1 + 0.2 * torch.randn(t.shape, generator=gen) if "norm" in name else 0.15 * torch.randn(t.shape, generator=gen))
    save_file(state, str(path / "model.safetensors"))
    return path


def run_paged_in_two_chunks(model, seqs: list[torch.Tensor], cuts: list[int], capture: tuple[int, ...]):
    """Our target over `seqs` batched on a paged cache of 4-token pages, in two chunks each (a prefill up to
    `cuts`, then a multi-token "verify" of the rest), so paging, varlen batching and cached keys all matter.
    Returns per sequence (logits [n, V], captured features [n, len(capture)·H])."""
    cache = model.new_cache(num_pages=32, page_size=4)
    ids = list(range(len(seqs)))
    for i in ids:
        cache.add_sequence(i)
    logits, feats = [], []
    with torch.no_grad():
        for lo, hi in (([0] * len(seqs), cuts), (cuts, [len(s) for s in seqs])):
            batch = cache.prepare(ids, [h - l for l, h in zip(lo, hi)])
            lg, ft = model(torch.cat([s[l:h] for s, l, h in zip(seqs, lo, hi)]), batch, cache, capture)
            for i, n in enumerate(batch.q_lens):
                cache.set_length(i, cache.lengths[i] + n)
            logits.append(lg.split(batch.q_lens))
            feats.append(ft.split(batch.q_lens))
    return [(torch.cat([logits[0][i], logits[1][i]]), torch.cat([feats[0][i], feats[1][i]])) for i in ids]


def assert_equals_transformers(hf, ours, seqs: list[torch.Tensor], cuts: list[int], capture: tuple[int, ...]) -> None:
    """Logits and features at `capture` equal transformers' (HF's hidden_states[l + 1] is layer l's output;
    the last one is final-normed), fp32."""
    with torch.no_grad():
        refs = [hf(s[None], output_hidden_states=True) for s in seqs]
    for (got_logits, got_feats), ref in zip(run_paged_in_two_chunks(ours, seqs, cuts, capture), refs):
        want_feats = torch.cat([ref.hidden_states[l + 1][0] for l in capture], dim=-1)
        torch.testing.assert_close(got_logits, ref.logits[0], atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(got_feats, want_feats, atol=2e-5, rtol=1e-4)
