"""The H200 profile's measured constants, fitted from a GPU run's JSON (``gpu-engine`` figures).

``python -m benchmarks.sim.gpu_fit [RESULTS_JSON]`` prints the profile fields this run gives
(default: ``RESULTS``, the H200 run of 2026-12-04, benchmarks/README.md "gpu-engine"):

* copy bandwidths: the run's pinned host -> device and device -> host GiB/s, and its device
  copy GB/s (bytes read + written), which prices a store's gather on the device;
* step costs: one least-squares fit, relative to each sample (the samples span 5 ms to 0.3 s),
  of the cost model's step (``cost_model.CostModel``) over every decode sample (batch, context,
  step time) and prefill sample (tokens in chunks of ``chunk``: one row per run, the sum of its
  chunks' steps). The engine attends a cold chunk with flash SDPA and a chunk after cached keys
  with its paged kernel; the cost model's one context term averages the two, so the prefill
  samples keep errors of about 10% each way (``fit.relative_errors``).
"""

import json
import sys
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).resolve().parents[1] / "results/gpu/2026-12-04-nvidia-h200.json"
STEP_FIELDS = (
    "step_fixed_s",
    "prefill_per_token_s",
    "prefill_per_token_context_s",
    "decode_per_seq_s",
    "decode_per_context_token_s",
)


def step_samples(run: dict) -> list[tuple[str, list[float], float]]:
    """``(label, cost model row, seconds)`` per decode and prefill sample of a gpu-engine run;
    a row's columns are ``STEP_FIELDS``' multipliers."""
    samples = []
    for d in run["decode"]:
        batch, context = d["batch"], d["context"]
        row = [1.0, 0.0, 0.0, batch, batch * context]
        samples.append((f"decode b{batch} ctx{context}", row, d["step_ms"] / 1e3))
    for p in run["prefill"]:
        tokens, chunk = p["tokens"], p["chunk"]
        row = [0.0] * 5
        for start in range(0, tokens, chunk):
            n = min(chunk, tokens - start)
            row = [a + b for a, b in zip(row, [1.0, n, n * (start + n / 2), 0.0, 0.0])]
        samples.append((f"prefill {tokens} in {chunk}", row, p["ms"] / 1e3))
    return samples


def fit_run(run: dict) -> dict[str, object]:
    """The profile fields a gpu-engine run measures, and the fit's per-sample relative error."""
    samples = step_samples(run)
    rows = np.asarray([row for _, row, _ in samples], dtype=float)
    seconds = np.asarray([s for _, _, s in samples])
    weights = 1.0 / seconds
    coef, *_ = np.linalg.lstsq(rows * weights[:, None], seconds * weights, rcond=None)
    if (coef <= 0).any():
        raise ValueError(f"a step cost fitted non-positive: {dict(zip(STEP_FIELDS, coef))}")
    errors = (rows @ coef - seconds) / seconds
    ceilings = run["ceilings"]
    return {
        **{name: float(c) for name, c in zip(STEP_FIELDS, coef)},
        "h2d_bytes_per_s": ceilings["h2d_gib_per_s"] * 2**30,
        "d2h_bytes_per_s": ceilings["d2h_gib_per_s"] * 2**30,
        "device_copy_bytes_per_s": ceilings["copy_gb_per_s"] * 1e9,
        "relative_errors": {label: float(e) for (label, _, _), e in zip(samples, errors)},
    }


def main(argv: list[str]) -> None:
    path = Path(argv[0]) if argv else RESULTS
    print(json.dumps(fit_run(json.loads(path.read_text())["gpu-engine"]), indent=2))


if __name__ == "__main__":
    main(sys.argv[1:])
