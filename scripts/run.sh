#!/usr/bin/env bash
# Set up (once) and run Strata's main job: serve configs/default.yaml on an embedded local Ray.
# Extra arguments go to `strata`, e.g. `bash scripts/run.sh generate --prompt "Hello"`.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/bootstrap.sh"
cd "$ROOT"
if [ "$#" -eq 0 ]; then
    set -- serve --config configs/default.yaml
fi
exec strata "$@"
