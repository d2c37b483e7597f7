#!/usr/bin/env bash
# Makes .venv-harness, the bench-only environment bench/peers/harness_check.py runs in: this project's own
# requirements plus lm-evaluation-harness 0.4.13 with its "hf" extra (HFLM). Never needed by the
# tests or requirements.txt.
#
#     bash bench/peers/harness_setup.sh          # then: .venv-harness/bin/python bench/peers/harness_check.py
#
# lm-eval 0.4.13 (the newest release) installs beside our pins: a constraints file made from
# requirements.txt's exact pins holds torch, transformers, datasets, tokenizers, huggingface_hub,
# numpy and the rest where they are, so pip may add packages but upgrades none of ours (it would
# stop with a conflict instead). It adds 32 packages (accelerate, peft, evaluate, scikit-learn,
# scipy, nltk, sacrebleu, rouge-score, pytablewriter, ...) and moves one unpinned package down:
# pytablewriter's typepy[datetime] caps python-dateutil below 3, so 4.0.0 becomes 2.9.0.post0
# (pandas and matplotlib accept it). The cost of the lm-eval step alone, its seconds and the MB it
# adds to the environment, is printed at the end; docs/evaluation.md has the figures.
# HARNESS_COLD=1 runs that step without pip's cache (every wheel downloaded, every sdist built).
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=.venv-harness
LM_EVAL=lm-eval==0.4.13
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q -r requirements.txt
CONSTRAINTS=$(mktemp)
grep -E '^[A-Za-z0-9_.-]+==' requirements.txt > "$CONSTRAINTS"
CACHE=()
if [ "${HARNESS_COLD:-0}" = 1 ]; then CACHE=(--no-cache-dir); fi
before=$(du -sm "$VENV" | cut -f1)
start=$(date +%s)
"$VENV/bin/pip" install -q "${CACHE[@]}" -c "$CONSTRAINTS" "lm-eval[hf]==${LM_EVAL#lm-eval==}"
end=$(date +%s)
after=$(du -sm "$VENV" | cut -f1)
rm -f "$CONSTRAINTS"
"$VENV/bin/python" - <<'EOF'
from importlib.metadata import version
import lm_eval  # noqa: F401  (imports: the install is usable)
from lm_eval.models.huggingface import HFLM  # noqa: F401
pins = {line.split("==")[0].lower(): line.split("==")[1].strip() for line in open("requirements.txt")
        if "==" in line and not line.startswith("#")}
moved = {name: (want, version(name)) for name, want in pins.items() if version(name).split("+")[0] != want}
assert not moved, f"lm-eval moved pinned packages: {moved}"
print("lm-eval", version("lm-eval"), "with torch", version("torch"), "transformers", version("transformers"),
      "datasets", version("datasets"), "(requirements.txt's pins)")
EOF
printf 'lm-eval step: %d s%s, %s MB added to %s (%s MB -> %s MB)\n' "$((end - start))" \
    "$([ "${HARNESS_COLD:-0}" = 1 ] && echo ' (cold: no pip cache)' || echo ' (pip cache as found)')" \
    "$((after - before))" "$VENV" "$before" "$after"
