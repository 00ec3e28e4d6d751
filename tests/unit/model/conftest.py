"""Fixtures for the model tests: ForwardBatch construction and tiny Hugging Face checkpoints."""

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from replicas.model import ForwardBatch

WORDS = ["hello", "world", "the", "cat", "sat", "on", "mat", "a", "dog", "ran"]
SPECIALS = ["<unk>", "<s>", "</s>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} "
    "{% endfor %}{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


@dataclass
class Chunk:
    """``num_new`` tokens of one sequence starting at position ``start``.

    ``tables`` maps a cache group to the sequence's block table (a list of block ids).
    """

    tokens: list[int]
    start: int
    num_new: int
    tables: dict[str, list[int]]


def build_batch(chunks: list[Chunk], block_size: int, pad_block: int = -1) -> ForwardBatch:
    """The ForwardBatch of ``chunks``; block tables are padded with ``pad_block``."""
    groups = list(chunks[0].tables)
    ids, positions, query_start_loc, seq_lens = [], [], [0], []
    slots: dict[str, list[int]] = {g: [] for g in groups}
    for c in chunks:
        for p in range(c.start, c.start + c.num_new):
            ids.append(c.tokens[p])
            positions.append(p)
            for g in groups:
                slots[g].append(c.tables[g][p // block_size] * block_size + p % block_size)
        query_start_loc.append(query_start_loc[-1] + c.num_new)
        seq_lens.append(c.start + c.num_new)
    tables = {}
    for g in groups:
        width = max(len(c.tables[g]) for c in chunks)
        rows = [c.tables[g] + [pad_block] * (width - len(c.tables[g])) for c in chunks]
        tables[g] = torch.tensor(rows, dtype=torch.int64)
    return ForwardBatch(
        input_ids=torch.tensor(ids, dtype=torch.int64),
        positions=torch.tensor(positions, dtype=torch.int64),
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        block_tables=tables,
        slot_mapping={g: torch.tensor(s, dtype=torch.int64) for g, s in slots.items()},
        logits_indices=torch.tensor([q - 1 for q in query_start_loc[1:]], dtype=torch.int64),
    )


# Prompts of the real-model tests (SmolLM2): a chat turn, code, prose.
SMOLLM2_PROMPTS = [
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "The history of the printing press begins",
]


@pytest.fixture(scope="module")
def one_torch_thread():
    """On a busy 2-core machine two torch threads per process are several times slower than one
    (the real-model tests took minutes instead of seconds)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def engine_greedy(loaded, prompts: list[list[int]], **params) -> list[list[int]]:
    """The output token ids of ``prompts`` run together through a CPU ``Engine`` on ``loaded``,
    greedy (``SamplingParams(temperature=0, **params)``)."""
    from replicas.config import EngineConfig
    from replicas.engine.engine import Engine
    from replicas.sampling_params import SamplingParams

    config = EngineConfig(model=loaded.args.name, device="cpu", num_npu_blocks=64)
    engine = Engine(config, loaded=loaded)
    sampling = SamplingParams(temperature=0, **params)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, sampling)
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output.token_ids
    return [finished[f"r{i}"] for i in range(len(prompts))]


@pytest.fixture
def make_batch() -> Callable[..., ForwardBatch]:
    return build_batch


@pytest.fixture
def chunk() -> type[Chunk]:
    return Chunk


def write_tokenizer(directory: Path, chat_template: str | None = CHAT_TEMPLATE) -> None:
    """A word-level tokenizer.json (ids 0-2 special) and its tokenizer_config.json."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {w: i for i, w in enumerate(SPECIALS + WORDS)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(SPECIALS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", vocab["<s>"])]
    )
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": {"content": "</s>"}, "add_bos_token": True}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights large enough that logits spread over several units, norms away from 1."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=generator)
            if "norm" in name:
                p.copy_(1.0 + 0.2 * noise)
            elif name.endswith("bias"):
                p.copy_(0.2 * noise)
            else:
                p.copy_(noise / p.shape[-1] ** 0.5)


@pytest.fixture
def hf_checkpoint(tmp_path: Path) -> Callable[..., tuple[Path, torch.nn.Module]]:
    """Saves a random transformers model of ``config`` to a directory with a tokenizer."""
    transformers = pytest.importorskip("transformers")

    def make(config, seed: int = 0, max_shard_size: str | None = None):
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
        randomize(model, seed)
        model.eval()
        directory = tmp_path / f"{config.model_type}-{seed}"
        kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
        model.save_pretrained(directory, **kwargs)
        write_tokenizer(directory)
        return directory, model

    return make
