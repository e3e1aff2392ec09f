#!/usr/bin/env bash
# The engine's GPU checks, under 8 minutes on one GPU: the CUDA tests (graphs, paged
# FlashAttention when installed, pinned KV transfer), decode tokens/s with CUDA graphs on
# and off at batch 1, 64 and 256 with the share of the HBM bound, and the CPU benchmark
# lines for comparison. Run from the repository root on a machine with CUDA and the dev
# setup (scripts/setup-dev.sh with a CUDA torch).
set -euo pipefail
PY=${PY:-.venv/bin/python}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$PY" -m pytest -q -m gpu tests/engine/test_cuda.py -p no:cacheprovider
"$PY" benchmarks/engine_cuda.py --dtype bfloat16 --batches 1 64 256
"$PY" -c "import flash_attn" 2>/dev/null \
  && "$PY" benchmarks/engine_cuda.py --dtype bfloat16 --batches 1 64 256 --block-size 256
