#!/usr/bin/env bash
# What the GPU checks (scripts/gpu-engine.sh) take along to a GPU machine that has CUDA
# torch, transformers and the usual scientific packages but no network: the wheels of
# the packages its image lacks (for its Python, default 3.12), at the versions this
# checkout's .venv runs, and SmolLM2's config and tokenizer (scripts/gpu_model.py; the
# 98 MB GGUF stays here, the weights are made there). Writes .gpu/ (git-ignored, ~10 MB):
#
#   scripts/gpu-bundle.sh            # here, after scripts/setup-dev.sh
#   scripts/gpu-engine.sh            # there, from the repository root, with .gpu/ beside it
#
#   GPU_PYTHON_VERSION=3.11 scripts/gpu-bundle.sh   # wheels for another interpreter
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-.venv/bin/python}
PYVER=${GPU_PYTHON_VERSION:-3.12}
OUT=.gpu
# Missing from the GPU image (its package list: ../.library/device/KINDS.md) and
# imported by the engine, its server, the local launcher or the CUDA tests.
PACKAGES=(pydantic pydantic-core annotated-types typing-inspection fastapi starlette
          uvicorn opentelemetry-api gguf pytest-asyncio)

say() { printf 'gpu-bundle: %s\n' "$*"; }
[ -x "$PY" ] || { echo "gpu-bundle: error: no $PY (run scripts/setup-dev.sh first)" >&2; exit 1; }

pinned=()
for name in "${PACKAGES[@]}"; do
    version=$("$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name") \
        || { echo "gpu-bundle: error: $name is not installed in $PY's environment" >&2; exit 1; }
    pinned+=("$name==$version")
done

rm -rf "$OUT/wheels"
mkdir -p "$OUT/wheels"
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
say "wheels for Python $PYVER: ${pinned[*]}"
platforms=()
for n in 17 24 27 28 31 34; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$PYVER" \
    --implementation cp "${platforms[@]}" --platform manylinux2014_x86_64 \
    --platform any -d "$OUT/wheels" "${pinned[@]}"
"$PY" scripts/gpu_model.py shape "$OUT/smollm2"
say "$(du -sh "$OUT" | cut -f1) in $OUT; on the GPU machine run scripts/gpu-engine.sh with $OUT carried"
