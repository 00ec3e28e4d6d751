"""Replicas placed over two Ray nodes (``ray.cluster_utils.Cluster``), in a separate process so
that the session's shared Ray instance is untouched."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("multinode_script.py")


@pytest.mark.parametrize(("strategy", "num_nodes"), [("STRICT_SPREAD", 2), ("STRICT_PACK", 1)])
def test_placement_strategy_spreads_or_packs_replicas(strategy, num_nodes):
    run = subprocess.run(
        [sys.executable, str(SCRIPT), strategy],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert run.returncode == 0, run.stderr[-3000:]
    line = next(x for x in run.stdout.splitlines() if x.startswith('{"nodes"'))
    result = json.loads(line)
    assert len(set(result["nodes"])) == num_nodes
    assert len(result["served_by"]) == 4 and set(result["served_by"]) <= {0, 1}
