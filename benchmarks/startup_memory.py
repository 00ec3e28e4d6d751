"""Start-up time and memory of loading a model with ``auto``: each load in a fresh process.

``python -m benchmarks.startup_memory MODEL [--threads 2] [--runs measured cached]``

For each run the child process imports Strata, then times ``replicas.model.load_model`` (with
``dtype``, ``quantization``, ``decoder_stack`` and ``int4_kernel`` all ``auto`` unless given)
over a choice cache of its own (``STRATA_AUTOTUNE_CACHE`` in a temporary folder): ``measured``
starts with that cache empty, so the candidates are timed; ``cached`` loads again with the
choice the ``measured`` run stored. It reports the start-up time, the process's peak resident
memory (``ru_maxrss``: the interpreter and torch included), its resident memory once loaded
(``VmRSS`` after a garbage collection: the steady state the engine starts from) and what was
chosen. The parent watches each child and kills it above ``--limit-gib`` of resident memory,
so that a load too large for the machine is reported, not swapped. ``--code DIR`` runs the
children on another checkout of Strata (an older commit, to compare).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = r"""
import gc, json, logging, resource, sys, time
import torch
torch.set_num_threads(int(sys.argv[2]))
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s: %(message)s")
from replicas.model import load_model
options = json.loads(sys.argv[3])
start = time.perf_counter()
loaded = load_model(sys.argv[1], torch.device("cpu"), **options)
startup_s = time.perf_counter() - start
gc.collect()
rss = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS:"))
print(json.dumps({
    "startup_s": startup_s,
    "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    "steady_rss_mib": rss / 1024,
    "chose": str(loaded.auto.candidate) if loaded.auto else "fixed",
    "source": loaded.auto.source if loaded.auto else "fixed",
}))
"""


def _rss_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return 0


def run_child(
    model: str, threads: int, options: dict, env: dict, code: Path, limit_gib: float
) -> dict:
    """One load in a fresh process; its report, or why it has none."""
    command = [sys.executable, "-c", CHILD, model, str(threads), json.dumps(options)]
    child = subprocess.Popen(
        command, cwd=code, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    watched_peak, start = 0, time.perf_counter()
    while child.poll() is None:
        watched_peak = max(watched_peak, _rss_kib(child.pid))
        if watched_peak > limit_gib * 2**20:
            child.kill()
            child.wait()
            return {"killed_above_gib": limit_gib, "after_s": time.perf_counter() - start}
        time.sleep(0.05)
    out, err = child.communicate()
    if child.returncode != 0:
        return {"failed": err.strip().splitlines()[-1:]}
    report = json.loads(out.strip().splitlines()[-1])
    report["log"] = [line for line in err.splitlines() if "auto" in line or "load" in line]
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", nargs="+", default=["measured", "cached"])
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--decoder-stack", default="auto")
    parser.add_argument("--int4-kernel", default="auto")
    parser.add_argument("--limit-gib", type=float, default=9.0)
    parser.add_argument("--code", type=Path, default=Path(__file__).resolve().parents[1])
    args = parser.parse_args(argv)
    options = {
        "dtype": args.dtype,
        "quantization": args.quantization,
        "decoder_stack": args.decoder_stack,
        "int4_kernel": args.int4_kernel,
    }
    with tempfile.TemporaryDirectory() as folder:
        env = dict(os.environ, STRATA_AUTOTUNE_CACHE=str(Path(folder) / "autotune.json"))
        for run in args.runs:
            if run == "measured":
                Path(env["STRATA_AUTOTUNE_CACHE"]).unlink(missing_ok=True)
            report = run_child(args.model, args.threads, options, env, args.code, args.limit_gib)
            print(json.dumps({"run": run, **report}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
