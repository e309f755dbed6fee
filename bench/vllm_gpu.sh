#!/usr/bin/env bash
# The vLLM backend proven on one CUDA GPU (cannot run in CPU CI). One script, four steps; each
# prints PASS/FAIL and the script exits non-zero on the first failure.
#   ./dev setup                      # on a GPU host: installs the [vllm] extra (vLLM 0.33.0)
#   bash bench/vllm_gpu.sh           # ~8-12 min on an H100/H200 (vLLM start-ups dominate)
# Steps:
#   1) GPU tests: tests/unit/test_backends_vllm.py (marker gpu): the seeded draws re-scored by an
#      fp32 hf reference, reproducibility, streamed weight swaps + prefix-cache reset; LoRA
#      versions per request (tests/unit/test_backends_vllm_lora_gpu.py);
#   2) bench/generate.py --gpu: node generation through the backend vs vLLM's offline engine alone
#      (target >= 90%) -> docs/benchmarks.md (generate_gpu);
#   3) a swarm (swarm demo) with one vLLM node and one hf node on the same model; the coordinator's
#      verdict receipts must show passed spot checks and no refusal for both
#      (bench/vllm_swarm_check.py);
#   4) bench/vllm_update.py: weight-update time per version, full and delta, of a 0.49B-parameter
#      Qwen2 -> docs/benchmarks.md (vllm_update).
# Environment: SWARM_SECONDS (swarm time limit, default 240), SKIP (e.g. "2 4" skips steps 2, 4).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-.venv/bin/python}"
[ -x "$PY" ] || PY=python
SWARM_SECONDS="${SWARM_SECONDS:-240}"
SKIP="${SKIP:-}"
OUT="${OUT:-runs/vllm-gpu-$(date -u +%Y%m%d-%H%M%S)}"
mkdir -p "$OUT"

step() { printf '\n\033[1m== step %s: %s\033[0m\n' "$1" "$2"; }
skipped() { case " $SKIP " in *" $1 "*) echo "skipped (SKIP=$SKIP)"; return 0 ;; esac; return 1; }

"$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "no CUDA GPU visible")'
"$PY" -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)'
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
# the seeded draws are declared the swarm's sampling rule for this run only (a node refuses the
# vllm backend otherwise; docs/backends.md)
export ROLLOUT_SWARM_VLLM_SEEDED_DRAWS=1

step 1 "GPU tests"
if ! skipped 1; then
    "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/unit/test_backends_vllm.py \
        tests/unit/test_backends_vllm_lora_gpu.py \
        2>&1 | tee "$OUT/gpu-tests.log"
fi

step 2 "generation: backend vs vLLM offline alone"
if ! skipped 2; then
    "$PY" bench/generate.py --gpu --repeats 3 2>&1 | tee "$OUT/generate-gpu.log"
fi

step 3 "swarm: one vLLM node + one hf node, spot checks must accept both"
if ! skipped 3; then
    model_dir="$OUT/model"
    "$PY" bench/vllm_model_dir.py "$model_dir"
    SWARM="$(dirname "$PY")/swarm"
    [ -x "$SWARM" ] || SWARM=swarm
    "$SWARM" demo --model-dir "$model_dir" --task reverse3 --nodes 2 \
        --node-backend vllm --node-backend hf \
        --time-limit "$SWARM_SECONDS" --no-live --run-dir "$OUT/swarm" \
        2>&1 | tee "$OUT/swarm.log" || true  # the receipts decide, not the demo's target
    "$PY" bench/vllm_swarm_check.py "$OUT/swarm" --backends vllm,hf --min-checked 4
fi

step 4 "weight-update time per version (0.49B parameters), full and delta"
if ! skipped 4; then
    "$PY" bench/vllm_update.py --versions 3 2>&1 | tee "$OUT/update.log"
fi

printf '\nall steps passed; logs in %s, figures in docs/benchmarks.md\n' "$OUT"
