"""``scripts/sim_records.py``'s comparison: every differing field, wall time ignored."""

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "sim_records.py"
spec = importlib.util.spec_from_file_location("sim_records", SCRIPT)
sim_records = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sim_records)


def test_differences_name_every_changed_leaf_and_ignore_wall_time():
    old = {"hit_rate": 0.5, "sim_wall_s": 3.0, "agent": {"per": [1, 2, 3]}, "gone": 1}
    new = {"hit_rate": 0.5, "sim_wall_s": 9.0, "agent": {"per": [1, 5, 3]}, "added": 2}
    assert sim_records.differences(old, new) == [
        "added: (missing) -> 2",
        "agent.per[1]: 2 -> 5",
        "gone: 1 -> (missing)",
    ]
    assert sim_records.differences(old, {**old, "sim_wall_s": 0.1}) == []
    assert sim_records.differences([1, 2], [1, 2, 3]) == [": [1, 2] -> [1, 2, 3]"]


def test_compare_counts_the_runs_that_differ(tmp_path, capsys):
    runs = {"a/seed=0": {"x": 1, "sim_wall_s": 1.0}, "b/seed=0": {"x": 2}}
    old, new = tmp_path / "old.json", tmp_path / "new.json"
    old.write_text(json.dumps({"runs": runs}))
    new.write_text(json.dumps({"runs": {**runs, "b/seed=0": {"x": 3}, "c/seed=0": {}}}))
    assert sim_records.compare(old, new) == 2
    out = capsys.readouterr().out
    assert "a/seed=0: equal" in out and "    x: 2 -> 3" in out and "c/seed=0: only in" in out
