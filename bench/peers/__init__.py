"""Ours against another project's code, run in an environment of its own: megatron-core
(peers_setup.sh makes .venv-megatron) and lm-evaluation-harness (harness_setup.sh, .venv-harness)."""
