"""The router's dependency rule (docs/design.md section 2): from ``replicas`` it imports only the
contract modules (block hashes, KV events, step costs), which pull in neither torch nor the
engine."""

import ast
import subprocess
import sys
from pathlib import Path

ROUTER = Path(__file__).resolve().parents[3] / "router"
CONTRACT = {"replicas.kv.hashing", "replicas.kv.events", "replicas.step_costs"}


def imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, absolute names (``from a import b`` counts ``a`` and
    ``a.b``: ``b`` may be a submodule)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_router_imports_only_the_contract_from_replicas():
    files = sorted(ROUTER.glob("**/*.py"))
    assert len(files) > 5
    for path in files:
        for name in imported_modules(path):
            if name == "replicas" or name.startswith("replicas."):
                parent = name.rpartition(".")[0]
                assert name in CONTRACT or parent in CONTRACT, f"{path.name} imports {name}"


def test_the_contract_pulls_in_neither_torch_nor_the_engine():
    code = (
        "import sys\n"
        f"for name in {sorted(CONTRACT)!r}: __import__(name)\n"
        "heavy = [m for m in sys.modules if m == 'torch' or m.startswith('replicas.engine')"
        " or m == 'replicas.calibration']\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROUTER.parent)


def test_the_replica_actors_module_pulls_in_neither_torch_nor_the_engine():
    """The router calls the replicas (resync, nodes, step costs): Ray loads the replica actor's
    class in every process that holds a handle to one, so its module must be light too (a
    router that imported torch on its first resync grew from 94 to 289 MiB)."""
    code = (
        "import sys\n"
        "import replicas.actor\n"
        "heavy = [m for m in sys.modules if m == 'torch' or m.startswith('replicas.engine')"
        " or m == 'replicas.calibration']\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROUTER.parent)
