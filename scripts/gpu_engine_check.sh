#!/usr/bin/env bash
# The engine path's end-to-end check, for the shipped small models (SmolLM2 target from `dflash-trt fetch-models`
# + examples/drafters/smollm2-dflash-b16), on the pinned platform (TensorRT-LLM 1.2.1, docker/Dockerfile).
#
#   scripts/gpu_engine_check.sh --dry-run    # CPU: every step that runs without a GPU (below)
#   scripts/gpu_engine_check.sh              # GPU + TensorRT-LLM: the same, then the engine build and run
#
# Steps that run anywhere:
#   1. the shipped pair converted to the one-engine checkpoint (`convert --format engine`: DFlashForCausalLM, what
#      trtllm-build reads), fp32;
#   2. the engine contract's CPU emulation (TensorRT-LLM's Eagle runtime side + our engine's per-call function) on
#      that checkpoint equals the reference runtime on it, token for token and draft for draft;
#   3. `dflash-trt build --dry-run` of a shipped build config prints its convert and trtllm-build commands;
#   4. steps 1 and 2 on a small random gpt-oss pair (scripts/tiny_gpt_oss.py: MoE, sinks, sliding windows, yarn);
#   5. the gpt-oss-120b NVFP4 TP8 build config checked against the released configs (examples/configs/).
# Steps that need a GPU + TensorRT-LLM 1.2.x (docker/Dockerfile):
#   6. trtllm-build of DFlashForCausalLM (trtllm/engine_network.py, through our registering wrapper) from step 1's
#      checkpoint, fp32, on the EAGLE contract; it uses TensorRT-LLM's own attention, so no cubins of ours;
#   7. that engine behind the executor (executor.EngineGenerator) on the same prompts = the reference runtime.
# They have never run (docs/engine-path.md, "Status": no GPU with TensorRT-LLM has been available to this project).
set -euo pipefail
cd "$(dirname "$0")/.."
DRY_RUN=0
[ "${1:-}" = "--dry-run" ] && DRY_RUN=1
TARGET=$(dflash-trt fetch-models --quiet | tail -n1)
DRAFTER=examples/drafters/smollm2-dflash-b16

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
echo "== 1/5 the one-engine checkpoint of the shipped pair (convert --format engine, fp32)"
dflash-trt convert --target "$TARGET" --drafter "$DRAFTER" --out "$WORK/engine-ckpt" --format engine --dtype fp32 --quiet

echo "== 2/5 engine contract emulation on that checkpoint vs the reference runtime (CPU)"
python -m dflash_trt.trtllm.emulation_check --checkpoint "$WORK/engine-ckpt"

echo "== 3/5 dflash-trt build --dry-run (build_configs/qwen3-8b-fp8-tp1.yaml)"
dflash-trt build --config build_configs/qwen3-8b-fp8-tp1.yaml --dry-run

echo "== 4/5 a small random gpt-oss pair: one-engine checkpoint + contract emulation vs the reference runtime (CPU)"
python scripts/tiny_gpt_oss.py --tokenizer "$TARGET" --out "$WORK/gpt-oss" >/dev/null
dflash-trt convert --target "$WORK/gpt-oss/target" --drafter "$WORK/gpt-oss/drafter" --out "$WORK/gpt-oss-ckpt" --format engine --dtype fp32 --quiet
python -m dflash_trt.trtllm.emulation_check --checkpoint "$WORK/gpt-oss-ckpt" --max-new-tokens 24

echo "== 5/5 dflash-trt build --dry-run (build_configs/gpt-oss-120b-nvfp4-tp8.yaml against examples/configs/)"
dflash-trt build --config build_configs/gpt-oss-120b-nvfp4-tp8.yaml --dry-run \
    --target-dir examples/configs/gpt-oss-120b --drafter-dir examples/configs/gpt-oss-120b-DFlash

if [ "$DRY_RUN" = 1 ]; then
    echo "dry run: every CPU step passed"
    exit 0
fi
echo "== 6/7 trtllm-build DFlashForCausalLM from the shipped pair's one-engine checkpoint (GPU, TensorRT-LLM 1.2.x)"
python -m dflash_trt.trtllm.engine_build --checkpoint_dir "$WORK/engine-ckpt" --output_dir "$WORK/engine" \
    --speculative_decoding_mode eagle --max_draft_len 15 --gpt_attention_plugin auto --gemm_plugin auto \
    --kv_cache_type paged --remove_input_padding enable --max_batch_size 4 --max_input_len 512 --max_seq_len 1024

echo "== 7/7 the engine behind the executor vs the reference runtime (same prompts, greedy)"
python -m dflash_trt.trtllm.emulation_check --checkpoint "$WORK/engine-ckpt" --engine "$WORK/engine"
