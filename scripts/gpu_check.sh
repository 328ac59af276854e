#!/usr/bin/env bash
# Prepared GPU check (see scripts/gpu_check.py): bf16 training, data wait, eval and a sample
# grid, FSDP on one GPU, latent-space training (bf16 VAE in the step), one FID/CMMD/DINO-MMD
# evaluation, the vLLM caption backend; one summary table. Under 10 minutes on one H200;
# every step prints "skipped: no CUDA" on a machine without a GPU.
#   scripts/gpu_check.sh [--steps train,data,decode,eval,fsdp,latent,metrics,vllm] [--work DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec timeout 600 python scripts/gpu_check.py "$@"
