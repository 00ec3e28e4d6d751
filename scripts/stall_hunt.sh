#!/usr/bin/env bash
# Hunt an event-loop stall: the HTTP fuzz module N times in a row (default 20), every fourth run
# after the fault tests, each run with its own hypothesis seed. faulthandler dumps every thread's
# stack when a run makes no progress for 120 s; each run's log is kept in $OUT (default a fresh
# temporary folder). Exit status 1 when any run failed or stalled.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/bootstrap.sh"
cd "$ROOT"
set +e  # a failed run is counted, and the hunt goes on
runs=${1:-20}
out=${OUT:-$(mktemp -d)}
status=0
for i in $(seq 1 "$runs"); do
  modules=(tests/reliability/test_http_fuzz.py)
  if (( i % 4 == 0 )); then modules=(tests/reliability/test_faults.py "${modules[@]}"); fi
  start=$(date +%s)
  timeout 900 python -m pytest -q -p no:cacheprovider -o faulthandler_timeout=120 \
    --hypothesis-seed="$i" "${modules[@]}" > "$out/run_$i.log" 2>&1
  rc=$?
  stalls=$(grep -c "Timeout (0:02:00)" "$out/run_$i.log" || true)
  echo "run $i: exit $rc, $(( $(date +%s) - start )) s, stall dumps $stalls: $(tail -1 "$out/run_$i.log")"
  if (( rc != 0 || stalls != 0 )); then status=1; fi
done
echo "logs in $out"
exit $status
