#!/usr/bin/env bash
# Makes .venv-megatron, the bench-only environment bench/peers/peers.py runs in: this project's own
# requirements plus megatron-core 0.19.2 and triton. Never needed by the tests or requirements.txt.
#
#     bash bench/peers/peers_setup.sh            # then: .venv-megatron/bin/python bench/peers/peers.py
#
# megatron-core 0.19.2's metadata asks for Python >= 3.12, but its cp311 wheel runs on our 3.11:
# pip download and pip install, both with --ignore-requires-python, take it, and --no-deps keeps pip
# from resolving its requirements (what it imports here, torch, numpy and packaging, come with ours).
# Its pipeline schedules import triton at module level, so triton comes too (unused on CPU).
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=.venv-megatron
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q -r requirements.txt
WHEELS=$(mktemp -d)
"$VENV/bin/pip" download -q megatron-core==0.19.2 --ignore-requires-python --no-deps -d "$WHEELS"
"$VENV/bin/pip" install -q --no-deps --ignore-requires-python "$WHEELS"/megatron_core-0.19.2-*.whl
"$VENV/bin/pip" install -q triton
rm -rf "$WHEELS"
"$VENV/bin/python" -c "import megatron.core, triton; print('megatron-core', megatron.core.__version__, 'in $VENV')"
