#!/usr/bin/env bash
# vLLM backend checks on a CUDA host (cannot run in CPU CI).
#   pip install -e '.[vllm,dev]'    # vllm>=0.8; >=0.10.2 for processed log-probs
#   bash bench/vllm_gpu.sh          # ~2-4 min, mostly vLLM start-up and CUDA graph capture
# 1) tests/unit/test_backends_vllm.py (marker gpu): log-probs vs an fp32 HF re-score under the
#    processed distribution, seeded reproducibility, in-place weight swap + prefix-cache reset;
# 2) tokens/s of vLLM vs the hf backend on the same GPU -> docs/benchmarks.md (generate_gpu).
set -euo pipefail
cd "$(dirname "$0")/.."
python -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "no CUDA GPU visible")'
python -c 'import vllm; print("vllm", vllm.__version__)'
python -m pytest -q -m gpu -p no:cacheprovider tests/unit/test_backends_vllm.py
python bench/generate.py --gpu --repeats 3 "$@"
