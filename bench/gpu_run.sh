#!/usr/bin/env bash
# The one command for the GPU machine (see bench/gpu_check.py): install the carried wheels
# (.gpu-wheels/, made by bench/gpu_wheels.sh) into .gpu-site/ without the network, run the
# check, and leave gpu_check.json and gpu_check.log in $OUT. Extra arguments go to the check.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-$PWD/artifacts/gpu}
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
export PYTHONPATH="$PWD/.gpu-site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
(
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv || true
    "$PY" -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.is_available())" || exit 3
    # The carried wheels win over whatever the machine has (.gpu-site is first on PYTHONPATH),
    # so the check runs with the versions the repository is tested with.
    if [ -d .gpu-wheels ] && [ ! -f .gpu-site/.from-wheels ]; then
        want=$(cat .gpu-wheels/PYTHON_VERSION 2>/dev/null || echo "?")
        have=$("$PY" -c "import sys; print('%d.%d' % sys.version_info[:2])")
        [ "$want" = "$have" ] || echo "warning: .gpu-wheels are for Python $want, this is $have"
        rm -rf .gpu-site
        if "$PY" -m pip --version >/dev/null 2>&1; then
            "$PY" -m pip install --quiet --disable-pip-version-check --no-index --find-links .gpu-wheels \
                --target .gpu-site -r bench/gpu_requirements.txt || exit 3
        else
            # No pip: a wheel is a zip laid out as site-packages.
            "$PY" -c "import zipfile, glob; [zipfile.ZipFile(w).extractall('.gpu-site') for w in glob.glob('.gpu-wheels/*.whl')]"
        fi
        touch .gpu-site/.from-wheels
    fi
    "$PY" -c "import pydantic, yaml, temporalio, boto3; print('pydantic', pydantic.VERSION, 'from', pydantic.__file__)" || {
        echo "error: pydantic, PyYAML, temporalio or boto3 missing: run bench/gpu_wheels.sh here and carry .gpu-wheels"
        exit 3
    }
) >"$LOG" 2>&1 || { cat "$LOG"; exit 3; }
"$PY" bench/gpu_check.py --json --out "$OUT/gpu_check.json" "$@" 2>>"$LOG"
rc=$?
echo "--- gpu_check.log (tail) rc=$rc"
tail -c 3000 "$LOG"
exit $rc
