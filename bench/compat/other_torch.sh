#!/usr/bin/env bash
# The fast tier and the layout-parity runs on another torch, in an environment of its own.
#   bash bench/compat/other_torch.sh              # torch 2.11.0 in .venv-torch2.11.0
#   bash bench/compat/other_torch.sh 2.15.0       # another version
# Builds the environment once (torch from the index pip is set to, then requirements.txt without
# its torch pin), then runs `pytest -m "not slow"` and tests/e2e/test_parity.py (every layout of
# the acceptance test against (1,1,1)). On a CPU-only machine the CUDA wheel PyPI serves works too:
# its CUDA libraries are installed and never loaded.
set -euo pipefail
cd "$(dirname "$0")/../.."
version=${1:-2.11.0}
venv=.venv-torch$version
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
    grep -v '^torch==' requirements.txt > "$venv/requirements-without-torch.txt"
    "$venv/bin/pip" install -q "torch==$version" -r "$venv/requirements-without-torch.txt"
fi
"$venv/bin/python" -c "import torch; print('torch', torch.__version__)"
start=$(date +%s)
"$venv/bin/python" -m pytest -q -m "not slow" tests
"$venv/bin/python" -m pytest -q tests/e2e/test_parity.py
echo "torch $version: fast tier and parity runs passed in $(( $(date +%s) - start )) s"
