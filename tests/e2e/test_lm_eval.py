"""lm-evaluation-harness's ``local-completions`` model against a Strata server (the default
real model) on a multiple-choice task shipped in the tests: its accuracy equals the accuracy
computed from Strata's in-process prompt logprobs, and the shared few-shot prefix is served from
the prefix cache. Needs ``pip install -e '.[eval]'`` (lm-eval); skipped without it."""

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from cluster import LLM, SamplingParams
from replicas.model.resolve import DEFAULT_MODEL, packaged_model_path
from tests.e2e.test_http_local import Server, default_model_server

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is not installed (the eval extra)")
try:
    packaged_model_path(DEFAULT_MODEL)
except FileNotFoundError as error:  # pragma: no cover - the test install provides it
    pytest.skip(str(error), allow_module_level=True)

DATA = Path(__file__).parents[1] / "data" / "lm_eval"
TASK = """\
task: strata_capitals
dataset_path: json
dataset_kwargs:
  data_files:
    train: {train}
    test: {test}
output_type: multiple_choice
training_split: train
test_split: test
fewshot_split: train
fewshot_config:
  sampler: first_n
num_fewshot: 4
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: " "
metric_list:
  - metric: acc
"""


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with default_model_server() as running:
        yield running


def cache_hits(server: Server) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    lines = [
        line for line in text.splitlines() if line.startswith("strata_prefix_cache_hits_total")
    ]
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines)


def test_lm_eval_accuracy_equals_strata_in_process_logprobs(server, tmp_path):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    (tmp_path / "task.yaml").write_text(
        TASK.format(train=DATA / "capitals_train.jsonl", test=DATA / "capitals_test.jsonl")
    )
    hits_before = cache_hits(server)
    results = simple_evaluate(
        model="local-completions",
        model_args=(
            f"base_url={server.url}/v1/completions,model={server.engine.loaded.name},"
            "num_concurrent=1,max_retries=1,tokenizer_backend=remote"
        ),
        tasks=["strata_capitals"],
        task_manager=TaskManager(include_path=str(tmp_path)),
        log_samples=True,
    )
    accuracy = results["results"]["strata_capitals"]["acc,none"]
    samples = results["samples"]["strata_capitals"]
    assert len(samples) == 16
    assert cache_hits(server) - hits_before > 0  # the few-shot prefix came from the cache

    # The same (context, continuation) pairs scored in process, without the harness.
    tokenizer = server.engine.tokenizer
    correct = 0
    with LLM(DEFAULT_MODEL, dtype="float32") as llm:  # as the server runs it
        for sample in samples:
            scores = []
            for context, continuation in sample["arguments"]:
                whole = tokenizer.encode(context + continuation, add_special_tokens=False)
                num_context = len(tokenizer.encode(context, add_special_tokens=False))
                output = llm.generate(whole, SamplingParams(max_tokens=1, prompt_logprobs=0))
                scores.append(sum(s.logprob for s in output.prompt_logprobs[num_context:]))
            correct += int(max(range(len(scores)), key=scores.__getitem__) == sample["target"])
    assert accuracy == pytest.approx(correct / len(samples))
    print(json.dumps({"lm_eval_acc": accuracy, "in_process_acc": correct / len(samples)}))
