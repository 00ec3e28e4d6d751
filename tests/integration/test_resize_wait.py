"""A scale-out on a Ray cluster that grows (``ray.cluster_utils.Cluster``, in a separate process
so that the session's shared Ray instance is untouched): ``scale(2)`` waits for a node to join
while the deployment serves, the new replica on that node pulls the prefix the first computed
through the peer tier with the cold run's tokens, a scale-out the cluster does not grow for
is refused after ``ray.scale_out_wait_s``, the deployment as it was, and a scale-in hands the
removed replica's blocks to the survivor on the other node."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).with_name("resize_wait_script.py")


def test_a_scale_out_waits_for_the_cluster_to_grow_and_is_refused_past_the_bound():
    run = subprocess.run(
        [sys.executable, str(SCRIPT)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert run.returncode == 0, run.stderr[-3000:]
    line = next(x for x in run.stdout.splitlines() if x.startswith('{"resize_wait"'))
    result = json.loads(line)["resize_wait"]
    # scale(2) waited for the node (serving meanwhile) and put replica 1 on it
    assert result["pending_after_2s"] and result["served_while_waiting"]
    assert result["scale"]["added_replicas"] == [1] and result["scale"]["data_parallel_size"] == 2
    assert result["nodes"][1] == result["added_node"] != result["nodes"][0]
    assert "wait up to 120 s (ray.scale_out_wait_s)" in run.stderr
    # replica 1 served the prompt from replica 0's blocks, pulled across nodes: same tokens
    cold_replica, cold_cached, cold_tokens = result["cold"]
    warm_replica, warm_cached, warm_tokens = result["warm"]
    assert (cold_replica, cold_cached) == (0, 0)
    assert warm_replica == 1 and warm_cached == result["warm_from_host"] == 160
    assert warm_tokens == cold_tokens
    assert result["peer_blocks_loaded"] == [0, 10]
    # the new replica timed pulls of 1 and 16 blocks from replica 0 before it took traffic
    # (besides its warm-up pull); replica 0, alone at the start, timed none
    timed = result["timed_pulls"]
    assert timed[0] == 0 and timed[1] >= 2 + 1
    # scale(4) with a bound of 2 s: refused, nothing changed, serving throughout
    refusal = result["refusal"]
    assert "within ray.scale_out_wait_s (2 s)" in refusal["error"]
    assert "2 more replica(s)" in refusal["error"] and "Ray placed 0 of 2" in refusal["error"]
    assert refusal["refused_s"] >= 2.0 and refusal["served_while_waiting"]
    assert refusal["size_after"] == 2 and refusal["members_after"] == [0, 1]
    assert refusal["served_after"] and refusal["pending_groups"] == 0
    # scale(1) removed replica 0 (head node); replica 1 (the other node) pulled its blocks first
    shrink = result["shrink"]
    assert shrink["first"][:2] == [0, 0] and shrink["removed"] == [0]
    assert shrink["after"] == [1, 160, shrink["first"][2]]
    assert "scale-in: replica 1 pulled" in run.stderr
