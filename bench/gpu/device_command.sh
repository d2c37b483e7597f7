#!/usr/bin/env bash
# The one command a GPU machine runs for bench/gpu_check.py (the device tool's `run`, carrying
# bench/gpu/wheelhouse, which bench/gpu/build_wheelhouse.sh builds where the registry is reachable):
#
#     bash bench/gpu/device_command.sh
#
# 1. installs the wheelhouse with no index (pip --no-index --find-links, into a folder of its own
#    on PYTHONPATH: the image's own packages stay as they are), unless deepspeed and datasets are
#    already importable (then it says so and installs nothing: the CPU dry run, the suite's venv);
# 2. runs every check on the first GPU offline (HF_HUB_OFFLINE and the rows' embedded corpus and
#    tokenizer), each under its own budget, the whole within GPU_CHECK_LIMIT_S (default 540 s):
#    bench/gpu_check.py --deadline-s cuts the last checks' budgets to what is left, and `timeout`
#    stops it (SIGTERM: the table still comes) if even that is overrun;
# 3. packs one archive, $OUT/gpu_check.tar.gz: the table (gpu_check.txt, gpu_check.json), this
#    script's log (device.log: the device, the packages' versions, the install), the check's
#    output (gpu_check.out), each check's log (gpu_check-logs/CHECK.log: an ERROR row's traceback;
#    its last lines are in the JSON too) and its folder (gpu_check-logs/CHECK/: the metrics its
#    runs wrote, one record a step, kept when the check is stopped). Exit: the check's.
#
# GPU_CHECK_DRY_RUN=1: the same command on a CPU machine, a CPU stand-in for each row (--cpu
# --standin): tests/analysis/test_gpu_check.py. GPU_CHECK_ARGS: more flags for bench/gpu_check.py.
set -uo pipefail
cd "$(dirname "$0")/../.."
began=$SECONDS
limit=${GPU_CHECK_LIMIT_S:-540}
out=${OUT:?"OUT: the folder the archive goes to"}
python=${PYTHON:-python3}
work=$(mktemp -d /tmp/gpu_check.XXXXXX)/gpu_check
mkdir -p "$work"
log=$work/device.log
say() { echo "$*" | tee -a "$log"; }

dry_run=${GPU_CHECK_DRY_RUN:-0}
# The packages the checks import, and their versions (the image's own, or the wheelhouse's).
versions='import importlib.metadata as m, sys
print("python", sys.version.split()[0])
for name in ("torch", "triton", "deepspeed", "datasets", "transformers", "tokenizers", "huggingface-hub", "numpy",
             "pyarrow", "pandas", "fsspec", "pydantic", "pydantic-core", "typing-extensions", "hjson", "dill"):
    try:
        print(name, m.version(name))
    except m.PackageNotFoundError:
        print(name, "missing")'
if [ "$dry_run" != 1 ]; then  # (a second of torch's import the dry run does without)
    { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || echo "no nvidia-smi"
      "$python" -c "import torch; print('cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())"
    } >>"$log" 2>&1
fi

found='import importlib.util as u, sys; sys.exit(not (u.find_spec("deepspeed") and u.find_spec("datasets")))'
if "$python" -c "$found"; then
    say "wheelhouse: not installed (deepspeed and datasets already importable)"
else
    site=/tmp/gpu_check_site
    if "$python" -m pip install -q --no-index --find-links bench/gpu/wheelhouse --no-deps --no-compile --upgrade \
            --no-cache-dir --target "$site" -r bench/gpu/wheelhouse/requirements.txt >>"$log" 2>&1; then
        say "wheelhouse: installed $(wc -l < bench/gpu/wheelhouse/requirements.txt) packages into $site"
    else
        say "wheelhouse: install FAILED (device.log); the checks run anyway and say what is missing"
    fi
    export PYTHONPATH=$site
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"  # the repository, not pip-installed there
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=disabled PYTHONUNBUFFERED=1
"$python" -c "$versions" >>"$log" 2>&1
if [ "$dry_run" != 1 ]; then  # what the wheelhouse brought imports with the image's packages (else: device.log)
    "$python" -c "import deepspeed, datasets" >>"$log" 2>&1 || say "deepspeed or datasets does not import (device.log)"
fi

if [ "$dry_run" = 1 ]; then
    flags=(--cpu --devices 1 --standin)
else
    flags=(--devices 1)
fi
left=$((limit - (SECONDS - began) - 20))  # 20 s: the archive, and `timeout`'s grace below
[ "$left" -ge 30 ] || left=30  # an install that ran long: the first checks still get a chance
# shellcheck disable=SC2086  # GPU_CHECK_ARGS: words
timeout -s TERM -k 5 $((left + 10)) "$python" bench/gpu_check.py "${flags[@]}" --deadline-s "$left" \
    --json-out "$work/gpu_check.json" ${GPU_CHECK_ARGS:-} 2>&1 | tee "$work/gpu_check.out"
code=${PIPESTATUS[0]}
say "gpu_check exit $code after $((SECONDS - began)) s of $limit"
tar -czf "$out/gpu_check.tar.gz" -C "$(dirname "$work")" gpu_check
rm -rf "$(dirname "$work")"
echo "archive: $out/gpu_check.tar.gz, $(du -k "$out/gpu_check.tar.gz" | cut -f1) KiB"
exit "$code"
