#!/usr/bin/env bash
# The one check a user with an NVIDIA GPU + TensorRT-LLM runs (e.g. inside docker/Dockerfile's image):
# build the shipped small models' engines (SmolLM2 target from `dflash-trt fetch-models` + the shipped
# drafter examples/drafters/smollm2-dflash-b16), run them through the trt backend with the one loop,
# and compare token for token with the reference runtime; print τ and speedup.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${DFLASH_PLUGIN_LIB:?set DFLASH_PLUGIN_LIB to libdflash_plugins.so (docker/Dockerfile builds it)}"
WORK=${WORK:-$(mktemp -d)}
TARGET=$(dflash-trt fetch-models --quiet | tail -n1)
DRAFTER=examples/drafters/smollm2-dflash-b16
ARCH=$(python -c "import json,sys; print(json.load(open(sys.argv[1]))['architectures'][0])" "$TARGET/config.json")

cat > "$WORK/smollm2.yaml" <<YAML
name: smollm2-dflash-b16-bf16-tp1
target: {model: $TARGET, architecture: $ARCH}
speculative_config: {decoding_type: DFlash, max_draft_len: 15, speculative_model: $DRAFTER}
convert: {dtype: bf16, quant: none, tp: 1}
build: {max_batch_size: 4, max_input_len: 1024, max_seq_len: 2048, max_num_tokens: 2048}
output_dir: $WORK/out
YAML

dflash-trt build --config "$WORK/smollm2.yaml" --plugin-lib "$DFLASH_PLUGIN_LIB"

python - "$TARGET" "$DRAFTER" "$WORK/out/engines" <<'PY'
import sys, time, torch
from dflash_trt.runtime import Generator
from dflash_trt.sampling import SamplingParams
from dflash_trt.torch_backend import load_torch_backend
from dflash_trt.trtllm.backend import TrtBackend
from dflash_trt.cli import load_tokenizer, encode_prompt

target, drafter, engines = sys.argv[1:]
tok = load_tokenizer(target)
prompts = [encode_prompt(tok, p, chat=True) for p in ["Explain speculative decoding in two sentences.", "Write a haiku about GPUs.", "What is 17 * 23?"]]
params = SamplingParams(max_new_tokens=128, temperature=0.0)

def run(backend, use_drafter=True):
    gen = Generator(backend, eos_token_ids=[tok.eos_token_id], max_batch=len(prompts), use_drafter=use_drafter)
    t = time.perf_counter(); outs = gen.generate(prompts, params); return outs, time.perf_counter() - t

ref, _ = run(load_torch_backend(target, drafter, torch.bfloat16, "cuda"))
trt_backend = TrtBackend(engines)
spec, t_spec = run(trt_backend)
plain, t_plain = run(trt_backend, use_drafter=False)
same = all(a.output_ids == b.output_ids == c.output_ids for a, b, c in zip(ref, spec, plain))
tau = sum(sum(o.accepted_lengths) for o in spec) / sum(len(o.accepted_lengths) for o in spec)
print(f"token-for-token equal to the reference runtime and to plain decoding: {same}")
print(f"tau = {tau:.2f} tokens/step; speedup over plain decoding on the same engines = {t_plain / t_spec:.2f}x")
sys.exit(0 if same else 1)
PY
