#!/usr/bin/env bash
# Set up (once) and run the whole test suite (lint included). Extra arguments go to pytest.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/bootstrap.sh"
cd "$ROOT"
ruff check .
ruff format --check .
exec python -m pytest -q -p no:cacheprovider "$@"
