#!/usr/bin/env bash
# Builds the wheelhouse bench/gpu/device_command.sh installs from on a GPU machine without network:
# exactly the packages bench/gpu_check.py's processes import that the GPU image lacks, for the
# image's platform (Python 3.12, manylinux x86_64; the device tool's KINDS.md lists what it holds).
#
#     bash bench/gpu/build_wheelhouse.sh [DIR]     # default bench/gpu/wheelhouse (git-ignored)
#
# Run on a machine that reaches the package registry. Prints the wheelhouse's size and exits 1 if it
# is over 60 MiB (it travels with the working tree, 64 MiB in all). The device's run carries DIR.
#
# What the check imports was recorded (sys.modules at exit, every process) over a training run of
# the MoE toy, the planner and a check's process; of that, the image lacks:
#   deepspeed (the engine, launch/engine/)        and, of its needs, hjson and pydantic (with
#                                                 pydantic-core, annotated-types, typing-inspection);
#   datasets (data/: imported by the data path    and, of its needs, dill and multiprocess.
#             even for the embedded corpus)
# Left out: wandb (every row runs with wandb.mode=disabled, so it is never imported) and every
# package the image has (torch, triton, transformers, tokenizers, huggingface-hub, numpy, pyarrow,
# pandas, fsspec, einops, msgpack, ninja, psutil, py-cpuinfo, tqdm, PyYAML, ...): their versions
# there are the image's, which bench/gpu/device_command.sh writes into its log.
set -euo pipefail
cd "$(dirname "$0")/../.."
dir=${1:-bench/gpu/wheelhouse}
python=${PYTHON:-.venv/bin/python}  # needs torch: deepspeed's setup.py imports it
limit_mib=60

pin() {  # NAME's version in requirements.txt
    local version
    version=$(sed -n "s/^$1==\([^ ]*\).*/\1/p" requirements.txt)
    [ -n "$version" ] || { echo "error: $1 is not pinned in requirements.txt" >&2; exit 2; }
    echo "$version"
}
# Direct requirements at requirements.txt's pins; their needs at the versions the CPU suite runs with.
wheels=("datasets==$(pin datasets)" hjson==3.1.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0
        typing-inspection==0.4.5 dill==0.4.1 multiprocess==0.70.19)
deepspeed="deepspeed==$(pin deepspeed)"

rm -rf "$dir" && mkdir -p "$dir"
platform=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none
          --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
          --platform manylinux1_x86_64 --platform any)
"$python" -m pip download -q --no-deps "${platform[@]}" -d "$dir" "${wheels[@]}"
# DeepSpeed publishes only a source distribution: built here into a pure-Python wheel with no
# prebuilt ops (DS_BUILD_OPS=0). The runs need none: the optimizer is torch's AdamW (torch_adam).
sdist=$(mktemp -d)
trap 'rm -rf "$sdist"' EXIT
"$python" -m pip download -q --no-deps --no-binary=:all: -d "$sdist" "$deepspeed"
DS_BUILD_OPS=0 "$python" -m pip wheel -q --no-deps --no-build-isolation -w "$dir" "$sdist"/deepspeed-*.tar.gz

printf '%s\n' "$deepspeed" "${wheels[@]}" > "$dir/requirements.txt"  # what device_command.sh installs
ls -l "$dir"
bytes=$(du -cb "$dir"/*.whl | tail -1 | cut -f1)
echo "wheelhouse $dir: $(ls "$dir"/*.whl | wc -l) wheels, $bytes bytes ($((bytes / 1024)) KiB), limit $limit_mib MiB"
if [ "$bytes" -gt $((limit_mib * 1024 * 1024)) ]; then
    echo "error: the wheelhouse is over $limit_mib MiB" >&2
    exit 1
fi
