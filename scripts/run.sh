#!/bin/sh
# Set up the project virtual environment (once) and run a task in it.
#
#   sh scripts/run.sh demo    # install everything, run the main demo
#   sh scripts/run.sh test    # install everything, run the test suite
#
# Needs only Python >= 3.11 with pip. Installs the core and every extra
# (experiments, kernels, dev), then torch-scatter and torch-sparse (the fast
# extra), compiled against the installed torch from source where pip finds no
# wheel (about 10 minutes on 2 cores, once; pip caches the wheels). Set
# TORCH_INDEX_URL to pick a torch build, e.g.
# https://download.pytorch.org/whl/cpu on a machine without CUDA.
set -eu
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=.venv
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
STAMP="$VENV/.sheafgnn-installed"
WANT="torch=$TORCH_VERSION $(cat pyproject.toml scripts/run.sh | cksum)"

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip"
# On PATH for torch.utils.cpp_extension, which builds the optional C++ kernels with ninja.
PATH="$(pwd)/$VENV/bin:$PATH"
export PATH
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
    $PIP install -q --upgrade pip setuptools wheel
    if [ -n "${TORCH_INDEX_URL:-}" ]; then
        $PIP install -q "torch==$TORCH_VERSION" --index-url "$TORCH_INDEX_URL"
    else
        $PIP install -q "torch==$TORCH_VERSION"
    fi
    $PIP install -q -e ".[experiments,kernels,dev]"
    # Build isolation would pull a second (CUDA) torch into the build env.
    MAX_JOBS=${MAX_JOBS:-2} $PIP install -q --no-build-isolation torch-scatter torch-sparse
    # The optional C++ kernels (sheafgnn.nn.cpu_kernels): built here once, about a minute, not in the first run.
    "$VENV/bin/python" -c "from sheafgnn.nn import cpu_kernels; cpu_kernels.block_topk(); cpu_kernels.ssm_step()"
    echo "$WANT" > "$STAMP"
fi

task=${1:-test}
shift || true
case "$task" in
    demo) exec "$VENV/bin/python" -m sheafgnn.cli demo "$@" ;;
    test) exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider "$@" ;;
    *) echo "usage: sh scripts/run.sh demo|test [args...]" >&2; exit 2 ;;
esac
