#!/usr/bin/env bash
# Prepared GPU check (see scripts/gpu_check.py): bf16 training, data wait, eval and a sample
# grid, FSDP on one GPU, the vLLM caption backend; one summary table. Under 8 minutes on one
# H200; every step prints "skipped: no CUDA" on a machine without a GPU.
#   scripts/gpu_check.sh [--steps train,data,eval,fsdp,vllm] [--work DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec timeout 480 python scripts/gpu_check.py "$@"
