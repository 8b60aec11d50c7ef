#!/usr/bin/env bash
# Prepare, on a machine with network, the wheels bench/gpu_check.py needs on the GPU machine
# (Python 3.12, no network): bench/gpu_requirements.txt and their dependencies, as manylinux
# x86_64 binary wheels, into the ignored .gpu-wheels/. bench/gpu_run.sh installs them there.
#
#   bash bench/gpu_wheels.sh            # cp312, for the GPU machine
#   GPU_PYVER=3.11 bash bench/gpu_wheels.sh   # for a local dry run under another Python
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PYVER=${GPU_PYVER:-3.12}
DEST=.gpu-wheels
MAX_MIB=40
rm -rf "$DEST"
mkdir -p "$DEST"
"$PY" -m pip download --quiet --disable-pip-version-check \
    --python-version "$PYVER" --implementation cp --only-binary=:all: \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    -d "$DEST" -r bench/gpu_requirements.txt
echo "$PYVER" > "$DEST/PYTHON_VERSION"
mib=$(( $(du -sb "$DEST" | cut -f1) / 1048576 ))
ls -1 "$DEST"
echo "$DEST: ${mib} MiB for Python $PYVER"
if (( mib > MAX_MIB )); then
    echo "error: $DEST is ${mib} MiB, over the ${MAX_MIB} MiB that leaves room in a 64 MiB carry" >&2
    exit 1
fi
