#!/usr/bin/env bash
# The sharded trainer on 2 CUDA GPUs (cannot run in CPU CI; not run on the project's machines yet).
#   pip install -e '.[dev]'          # with a CUDA build of torch (FSDP2: torch.distributed.fsdp)
#   bash bench/trainer_gpu.sh        # a few minutes
# 1) tests/integration/test_trainer_fsdp.py -m gpu: FSDP2 over NCCL on 2 GPUs against 1 GPU (same
#    weights after 2 steps within the GPU margins, micro-batches and activation checkpointing on),
#    resume from the sharded checkpoint on 2 GPUs, from a 1-GPU checkpoint, 2 -> 1 resharding, and
#    the published version equal bit for bit to the ranks' shards and loading in a node;
# 2) step time and peak GPU memory per rank, 1 vs 2 GPUs, SmolLM2-135M-sized model, bf16
#    autocast -> docs/benchmarks.md (section trainer_fsdp_gpu).
set -euo pipefail
cd "$(dirname "$0")/.."
python -c 'import torch, sys; n = torch.cuda.device_count(); sys.exit(0 if n >= 2 else f"needs 2 CUDA GPUs, {n} visible")'
python -m pytest -q -m gpu -p no:cacheprovider tests/integration/test_trainer_fsdp.py
python bench/trainer_fsdp.py --gpu --groups 8 --tokens 256 --steps 5 "$@"
