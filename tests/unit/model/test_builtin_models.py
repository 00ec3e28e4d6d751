"""The built-in models: seeded weights and logits peaked enough for exact greedy comparisons."""

import torch

from replicas.model import BUILTIN_MODELS, ByteTokenizer, load_model

CPU = torch.device("cpu")
BLOCK_SIZE = 16


def test_names():
    assert BUILTIN_MODELS == ("tiny", "tiny-hybrid", "llama3-8b-shape", "qwen3-8b-shape")


def test_real_shapes_have_the_real_parameter_counts():
    """Built on the meta device (nothing allocated): Llama-3-8B's 8,030,261,248 parameters
    and Qwen3-8B's 8,190,735,360, as their model cards count them."""
    from replicas.model.builtin import BUILTIN_MODEL_ARGS
    from replicas.model.registry import build_model

    for name, count in (("llama3-8b-shape", 8_030_261_248), ("qwen3-8b-shape", 8_190_735_360)):
        with torch.device("meta"):
            net = build_model(BUILTIN_MODEL_ARGS[name]())
        assert sum(p.numel() for p in net.parameters()) == count, name


def test_same_seed_same_weights():
    a = load_model("tiny", CPU, seed=3).model.state_dict()
    b = load_model("tiny", CPU, seed=3).model.state_dict()
    c = load_model("tiny", CPU, seed=4).model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["tok_embeddings.weight"], c["tok_embeddings.weight"])


def test_shapes():
    tiny = load_model("tiny", CPU).args
    hybrid = load_model("tiny-hybrid", CPU)
    assert (tiny.vocab_size, tiny.num_layers, tiny.head_dim, tiny.num_kv_heads) == (258, 4, 64, 2)
    assert tiny.bos_token_id == 256 and tiny.eos_token_ids == (257,)
    specs = hybrid.model.kv_cache_specs(torch.float32)
    assert specs["full"].num_layers == 2 and specs["sliding"].num_layers == 4
    assert specs["sliding"].sliding_window == 64


def greedy(model, tokenizer, text, num_steps, make_batch, chunk):
    """Greedy decoding through the block KV cache; returns the generated ids and top-2 gaps."""
    tokens = tokenizer.encode(text)
    specs = model.kv_cache_specs(torch.float32)
    caches = {g: torch.zeros(s.shape(16, BLOCK_SIZE)) for g, s in specs.items()}
    tables = {g: list(range(16)) for g in specs}
    start, gaps, out = 0, [], []
    with torch.no_grad():
        for _ in range(num_steps):
            batch = make_batch([chunk(tokens, start, len(tokens) - start, tables)], BLOCK_SIZE)
            logits = model.compute_logits(model(batch, caches)[batch.logits_indices])[0]
            top2 = logits.topk(2).values
            gaps.append((top2[0] - top2[1]).item())
            start = len(tokens)
            tokens.append(int(logits.argmax()))
            out.append(tokens[-1])
    return out, gaps


def test_logits_are_peaked_and_greedy_output_varies(make_batch, chunk):
    loaded = load_model("tiny", CPU)
    all_gaps = []
    for text in ["The quick brown fox", "def main():", "你好", "a"]:
        out, gaps = greedy(loaded.model, loaded.tokenizer, text, 40, make_batch, chunk)
        all_gaps += gaps
        assert len(set(out)) >= 10
        assert max(out) < ByteTokenizer().vocab_size
    assert torch.tensor(all_gaps).median() > 1.0
    assert min(all_gaps) > 1e-3


def test_bfloat16_agrees_with_float32(make_batch, chunk):
    tokens = ByteTokenizer().encode("The quick brown fox jumps over the lazy dog. " * 2)
    argmax = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = load_model("tiny", CPU, dtype=dtype).model
        specs = model.kv_cache_specs(dtype)
        caches = {g: torch.zeros(s.shape(8, BLOCK_SIZE), dtype=dtype) for g, s in specs.items()}
        batch = make_batch([chunk(tokens, 0, len(tokens), {"full": list(range(8))})], BLOCK_SIZE)
        with torch.no_grad():
            logits = model.compute_logits(model(batch, caches))
        assert logits.dtype == torch.float32
        argmax[dtype] = logits.argmax(-1)
    assert (argmax[torch.float32] == argmax[torch.bfloat16]).float().mean() > 0.9


def test_hybrid_chunked_with_freed_window_blocks_matches_one_prefill(make_batch, chunk):
    loaded = load_model("tiny-hybrid", CPU)
    model, window = loaded.model, loaded.args.sliding_window
    tokens = loaded.tokenizer.encode("Sliding windows forget what lies behind them. " * 4)
    num_tokens = len(tokens)
    full_table, sliding_table = list(range(12)), list(range(12, 24))

    def fresh_caches():
        specs = model.kv_cache_specs(torch.float32)
        return {g: torch.zeros(s.shape(24, BLOCK_SIZE)) for g, s in specs.items()}

    tables = {"full": full_table, "sliding": sliding_table}
    batch = make_batch([chunk(tokens, 0, num_tokens, tables)], BLOCK_SIZE)
    with torch.no_grad():
        expected = model.compute_logits(model(batch, fresh_caches()))
    caches = fresh_caches()
    schedule = [(0, 70), (70, 60)] + [(p, 1) for p in range(130, num_tokens)]
    for start, num_new in schedule:
        first_kept = max(0, start - window + 1) // BLOCK_SIZE
        for block in sliding_table[:first_kept]:
            caches["sliding"][block] = float("nan")
        stale = [-1] * first_kept + sliding_table[first_kept:]
        step_tables = {"full": full_table, "sliding": stale}
        batch = make_batch([chunk(tokens, start, num_new, step_tables)], BLOCK_SIZE)
        with torch.no_grad():
            logits = model.compute_logits(model(batch, caches))
        torch.testing.assert_close(logits, expected[start : start + num_new], atol=1e-4, rtol=1e-4)
