"""How often a trace requests a prompt block again, split by what a replica knows of the block.

``python -m benchmarks.sim.reuse --trace TRACE [--window-s 300]``

A retention policy decides, when the NPU tier evicts a block, whether the host tier keeps it; it
can only be better than storing every block (write-back) or none if something it knows of the
block tells reused blocks from the rest. This reads the trace alone (no simulation): for every
prompt block a request computes (past the longest prefix an earlier request already held), the
share requested again within ``--window-s`` seconds, by

* the block's position in the prompt, and its distance from the prompt's last full block;
* its offset past the prefix the request shared with earlier ones;
* whether the request shared more than its first block with an earlier one (a follow-up turn);
* the request's prompt length and output length.

A split whose groups share about the same reuse gives a policy nothing to choose by.
"""

import argparse
import bisect
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

from benchmarks.sim.trace import TraceRecord, load_trace

Key = Callable[[TraceRecord, int, int], object]  # (record, position, shared blocks) -> group

SPLITS: dict[str, Key] = {
    "position (blocks, groups of 4)": lambda r, p, s: min(p // 4, 10),
    "blocks from the prompt's end": lambda r, p, s: min(len(r.hash_ids) - 1 - p, 8),
    "offset past the shared prefix": lambda r, p, s: min(p - s, 8),
    "follow-up (shares more than block 0)": lambda r, p, s: s > 1,
    "prompt length (blocks, groups of 16)": lambda r, p, s: min(len(r.hash_ids) // 16, 6),
    "output length (tokens, groups of 200)": lambda r, p, s: min(r.output_length // 200, 6),
}


def reuse_by_split(records: list[TraceRecord], window_s: float) -> dict[str, dict]:
    """Split name -> group -> (new blocks, share requested again within ``window_s``)."""
    prefixes = [_prefix_keys(r.hash_ids) for r in records]
    times: dict[int, list[float]] = defaultdict(list)  # prefix -> arrival times (sorted)
    for record, keys in zip(records, prefixes, strict=True):
        for key in keys:
            times[key].append(record.timestamp_ms / 1000)
    counts: dict[str, dict] = {name: defaultdict(lambda: [0, 0]) for name in SPLITS}
    seen: set[int] = set()
    for record, keys in zip(records, prefixes, strict=True):
        now = record.timestamp_ms / 1000
        shared = 0
        while shared < len(keys) and keys[shared] in seen:
            shared += 1
        for position in range(shared, len(keys)):
            arrivals = times[keys[position]]
            later = bisect.bisect_right(arrivals, now)
            reused = later < len(arrivals) and arrivals[later] - now <= window_s
            for name, split in SPLITS.items():
                group = counts[name][split(record, position, shared)]
                group[0] += 1
                group[1] += reused
        seen.update(keys)
    return {
        name: {g: (n, reused / n) for g, (n, reused) in sorted(groups.items())}
        for name, groups in counts.items()
    }


def _prefix_keys(hash_ids: tuple[int, ...]) -> list[int]:
    """One key per prefix: equal only for equal prefixes (as chained block hashes are)."""
    keys, key = [], 0
    for hash_id in hash_ids:
        key = hash((key, hash_id))
        keys.append(key)
    return keys


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sim.reuse", description=__doc__)
    parser.add_argument("--trace", type=Path, required=True, help="a Mooncake-format JSONL trace")
    parser.add_argument("--window-s", type=float, default=300.0, help="reuse horizon (300 s)")
    args = parser.parse_args()
    if args.window_s <= 0:
        raise SystemExit(f"--window-s must be positive, got {args.window_s}")
    records = load_trace(args.trace)
    splits = reuse_by_split(records, args.window_s)
    first = next(iter(splits.values())).values()
    total = sum(n for n, _ in first)
    overall = sum(n * share for n, share in first) / total if total else 0.0
    print(
        f"{args.trace.name}: {total} new prompt blocks, {overall:.3f} of them requested again "
        f"within {args.window_s:g} s; that share by group (blocks in it):"
    )
    for name, groups in splits.items():
        cells = ", ".join(f"{g}: {share:.3f} ({n})" for g, (n, share) in groups.items())
        print(f"  {name}: {cells}")


if __name__ == "__main__":
    main()
