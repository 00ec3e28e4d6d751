"""Tool calls in chat completions: the Hermes format's parser (whole and streamed), the prompt
rendering fallback, the call grammars (through llguidance's matcher) and the renderer's deltas."""

import itertools
import json
import random

import pytest

from cluster.api.protocol import ChatMessage
from cluster.api.tools import ToolChatRenderer, messages_with_tools_as_text, tool_format
from cluster.api.tools.prompt import render_chat_prompt
from replicas.engine.structured_output import GrammarCompiler, StructuredOutputs, lark_json
from replicas.model.tokenizer import ByteTokenizer, HFTokenizer
from replicas.outputs import RequestOutput

HERMES = tool_format("hermes")
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1},
    },
    "required": ["city"],
}
TIME = {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
CALL_WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CALL_TIME = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def hf_tokenizer(template: str) -> HFTokenizer:
    tokenizers = pytest.importorskip("tokenizers")
    rust = tokenizers.Tokenizer(tokenizers.models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
    return HFTokenizer.from_tokenizer(rust, chat_template=template)


# ---- parsing ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, content, calls",
    [
        ("Just text.", "Just text.", []),
        (CALL_WEATHER, None, [("get_weather", '{"city": "Paris"}')]),
        (
            f"Let me check.\n{CALL_WEATHER}\n{CALL_TIME}",
            "Let me check.\n",
            [("get_weather", '{"city": "Paris"}'), ("get_time", '{"zone": "CET"}')],
        ),
        # Braces and quotes inside strings do not end the arguments.
        (
            '<tool_call>\n{"name": "f", "arguments": {"s": "a}\\"b", "l": [1, {"k": []}]}}\n'
            "</tool_call>",
            None,
            [("f", '{"s": "a}\\"b", "l": [1, {"k": []}]}')],
        ),
        ("Almost a tag: <tool_c", "Almost a tag: <tool_c", []),  # at the end: it is text
        ('Cut <tool_call>\n{"name": "get_wea', "Cut ", []),  # cut before the name: dropped
        ('<tool_call>\n{"name": "f", "arguments": {"s": "ab', None, [("f", '{"s": "ab')]),
        # Another layout than the grammar's is still read as a call.
        ('<tool_call>{"arguments": {"a": 1}, "name": "f"}</tool_call>', None, [("f", '{"a": 1}')]),
        ("<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
    ],
)
def test_hermes_parse(text, content, calls):
    parsed = HERMES.parse(text)
    assert parsed.content == content
    assert [(c.name, c.arguments) for c in parsed.calls] == calls


def reassemble(pieces: list[str]) -> tuple[str, list[tuple[str, str]]]:
    """Feeds ``pieces`` to a stream; the content and the calls its deltas add up to."""
    stream = HERMES.stream()
    content, names, arguments = "", {}, {}
    released = [stream.feed(piece) for piece in pieces] + [stream.finish()]
    for piece in released:
        content += piece.content
        for delta in piece.calls:
            if delta.name is not None:
                assert delta.index not in names and delta.arguments == ""
                names[delta.index] = delta.name
            assert delta.index in names  # fragments come after the call's first delta
            arguments[delta.index] = arguments.get(delta.index, "") + delta.arguments
    assert stream.num_calls == len(names)
    return content, [(names[i], arguments[i]) for i in sorted(names)]


@pytest.mark.parametrize("seed", range(20))
def test_streaming_reassembles_to_the_whole_parse(seed):
    text = f"Sure: <tool_ <b>{CALL_WEATHER}\n{CALL_TIME}"
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, 30)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    parsed = HERMES.parse(text)
    content, calls = reassemble(pieces)
    assert content == parsed.content == "Sure: <tool_ <b>"
    assert calls == [(c.name, c.arguments) for c in parsed.calls]
    assert calls == [("get_weather", '{"city": "Paris"}'), ("get_time", '{"zone": "CET"}')]


def test_stream_holds_back_a_possible_tag_and_never_leaks_markup():
    stream = HERMES.stream()
    assert stream.feed("Hello <tool").content == "Hello "
    assert stream.feed("_c").content == ""
    piece = stream.feed('all>\n{"name": "get_time", "arguments": {"zo')
    assert piece.content == ""
    assert [(d.index, d.name, d.arguments) for d in piece.calls] == [
        (0, "get_time", ""),
        (0, None, '{"zo'),
    ]
    piece = stream.feed('ne": "UTC"}}\n</tool_call>')
    assert piece.content == "" and [d.arguments for d in piece.calls] == ['ne": "UTC"}']
    assert stream.feed("\n").content == ""  # whitespace after a call is not content
    assert stream.feed("<tool_call>\n").calls == []
    assert stream.finish().content == ""
    assert stream.num_calls == 1
    text_stream = HERMES.stream()
    assert text_stream.feed("a <b> c <").content == "a <b> c "
    assert text_stream.feed("div>").content == "<div>"


# ---- rendering -------------------------------------------------------------------------------


def conversation() -> list[list[dict]]:
    """The messages of turns 1 to 3 of a tool conversation (as ``to_template`` gives them)."""
    turn1 = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather and time in Paris?"},
    ]
    call = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            },
            {
                "id": "call_2",
                "type": "function",
                "function": {"name": "get_time", "arguments": '{"zone": "CET"}'},
            },
        ],
    }
    results = [
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "14:05"},
    ]
    turn2 = turn1 + [call, *results]
    turn3 = turn2 + [
        {"role": "assistant", "content": "Sunny, 21 C; it is 14:05."},
        {"role": "user", "content": "Thanks!"},
    ]
    as_template = [
        [ChatMessage.model_validate(m).to_template() for m in t] for t in (turn1, turn2, turn3)
    ]
    return as_template


@pytest.mark.parametrize("make", [ByteTokenizer, lambda: hf_tokenizer(SMOLLM2_TEMPLATE)])
def test_fallback_rendering_turn_n_is_a_prefix_of_turn_n_plus_1(make):
    tokenizer = make()
    assert not tokenizer.chat_template_takes_tools
    turns = conversation()
    prompts = [render_chat_prompt(tokenizer, t, TOOLS, HERMES) for t in turns]
    for before, after in itertools.pairwise(prompts):
        assert after.startswith(before)
    # The tools block opens the system message, before its own text.
    tools_at = prompts[0].index("<tools>\n" + json.dumps(TOOLS[0]))
    assert tools_at < prompts[0].index("Be brief.") < prompts[0].index("Weather and time")
    # The model's calls are rendered as it writes them; results as one user message.
    assert prompts[1].endswith(
        f"{CALL_WEATHER}\n{CALL_TIME}"
        + {ByteTokenizer: "\n<|user|>\n", HFTokenizer: "<|im_end|>\n<|im_start|>user\n"}[
            type(tokenizer)
        ]
        + "<tool_response>\nsunny, 21 C\n</tool_response>\n<tool_response>\n14:05\n"
        "</tool_response>"
        + {ByteTokenizer: "\n<|assistant|>\n", HFTokenizer: "<|im_end|>\n<|im_start|>assistant\n"}[
            type(tokenizer)
        ]
    )
    # The turn's token ids share the previous turn's as a prefix, too.
    if isinstance(tokenizer, ByteTokenizer):
        first, second = (tokenizer.encode(p) for p in prompts[:2])
        assert second[: len(first)] == first


@pytest.mark.parametrize(
    "arguments", ['{"city": "Zürich", "days": [1, 2]}', '"just a string"', "not json {"]
)
def test_history_calls_are_written_as_the_model_writes_them(arguments):
    message = {"role": "assistant", "content": "On it.", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}
    ]}  # fmt: skip
    [rendered] = messages_with_tools_as_text(
        [ChatMessage.model_validate(message).to_template()], None, HERMES
    )
    call = f'<tool_call>\n{{"name": "f", "arguments": {arguments}}}\n</tool_call>'
    assert rendered == {"role": "assistant", "content": "On it." + call}
    assert HERMES.parse(rendered["content"]).content == "On it."


def test_fallback_adds_a_system_message_and_leaves_the_given_ones_alone():
    messages = [{"role": "user", "content": "Hi"}]
    rewritten = messages_with_tools_as_text(messages, TOOLS, HERMES)
    assert rewritten[0] == {"role": "system", "content": HERMES.system_prompt(TOOLS)}
    assert rewritten[1:] == messages and messages == [{"role": "user", "content": "Hi"}]
    assert messages_with_tools_as_text(messages, None, HERMES) == messages


def test_a_template_that_reads_tools_gets_them():
    template = (
        "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
        "{% for m in messages %}{{ m.role }}:{{ m.content }}"
        "{% for c in m.tool_calls or [] %}[{{ c.function.name }} {{ c.function.arguments.city }}]"
        "{% endfor %}\n{% endfor %}"
    )
    tokenizer = hf_tokenizer(template)
    assert tokenizer.chat_template_takes_tools
    prompt = render_chat_prompt(tokenizer, conversation()[1], TOOLS, HERMES)
    assert prompt.startswith("TOOLS:get_weather;get_time;system:Be brief.user:")
    assert "assistant:[get_weather Paris][get_time ]" in prompt  # arguments parsed from JSON
    assert "<tool_call>" not in prompt and "tool:sunny, 21 Ctool:14:05" in prompt
    assert render_chat_prompt(tokenizer, conversation()[0], None, HERMES).startswith("system:")


# ---- grammars --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler(ByteTokenizer(), ByteTokenizer().vocab_size)


def accepts(compiler: GrammarCompiler, grammar: str, text: str) -> bool:
    """Whether ``text`` followed by EOS is a whole output of ``grammar``."""
    matcher = compiler.matcher(StructuredOutputs(grammar=grammar))
    try:
        for token in [*text.encode(), ByteTokenizer.EOS]:
            matcher.accept(token)
    except ValueError:
        return False
    return matcher.is_terminated


def test_a_lark_grammar_is_a_structured_output_checked_when_compiled(compiler):
    grammar = 'start: "x" body\nbody: ' + lark_json({"type": "object", "properties": {}})
    assert accepts(compiler, grammar, "x{}")
    assert not accepts(compiler, grammar, 'x{"a": 1}')  # objects are closed, as for json
    with pytest.raises(ValueError, match=r"grammar is not a valid Lark grammar"):
        compiler.validate(StructuredOutputs(grammar="start: nowhere"))
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputs(grammar="start: x", regex="x")


FUNCTIONS = [("get_weather", WEATHER), ("get_time", TIME)]
BAD_CALLS = [
    '<tool_call>\n{"name": "get_date", "arguments": {}}\n</tool_call>',  # no such function
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": 3}}\n</tool_call>',  # type
    '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>',  # required missing
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "P", "unit": "kelvin"}}\n'
    "</tool_call>",  # not in the enum
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "P", "days": 0}}\n</tool_call>',
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "P", "x": 1}}\n</tool_call>',
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "P"}}',  # not closed
    '<tool_call>\n{"name":"get_weather","arguments":{"city":"P"}}\n</tool_call>',  # layout
]


def test_required_grammar_accepts_valid_calls_only(compiler):
    grammar = HERMES.grammar(FUNCTIONS, is_required=True, is_parallel=True)
    good = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "P", "unit": "celsius", '
    good += '"days": 3}}\n</tool_call>'
    assert accepts(compiler, grammar, good)
    assert accepts(compiler, grammar, f"{CALL_WEATHER}\n{CALL_TIME}\n{CALL_WEATHER}")
    assert not accepts(compiler, grammar, "I would rather answer.")
    assert not accepts(compiler, grammar, "")
    assert not accepts(compiler, grammar, f"Text first {CALL_WEATHER}")
    for bad in BAD_CALLS:
        assert not accepts(compiler, grammar, bad), bad
    single = HERMES.grammar(FUNCTIONS, is_required=True, is_parallel=False)
    assert accepts(compiler, single, CALL_TIME)
    assert not accepts(compiler, single, f"{CALL_WEATHER}\n{CALL_TIME}")


def test_named_grammar_calls_that_function_only(compiler):
    grammar = HERMES.grammar(FUNCTIONS[1:], is_required=True, is_parallel=True)
    assert accepts(compiler, grammar, CALL_TIME)
    assert not accepts(compiler, grammar, CALL_WEATHER)


def test_auto_grammar_allows_text_or_calls(compiler):
    grammar = HERMES.grammar(FUNCTIONS, is_required=False, is_parallel=True)
    assert accepts(compiler, grammar, "The weather is fine <tool_c, no call.")
    assert accepts(compiler, grammar, CALL_WEATHER)
    assert accepts(compiler, grammar, f"Checking.\n{CALL_WEATHER}\n{CALL_TIME}")
    assert not accepts(compiler, grammar, f"{CALL_WEATHER} and then text")
    for bad in BAD_CALLS:
        assert not accepts(compiler, grammar, bad), bad
        assert not accepts(compiler, grammar, "Text first. " + bad), bad
    single = HERMES.grammar(FUNCTIONS, is_required=False, is_parallel=False)
    assert accepts(compiler, single, f"One: {CALL_TIME}")
    assert not accepts(compiler, single, f"{CALL_WEATHER}\n{CALL_TIME}")


def test_none_grammar_allows_text_without_call_markup(compiler):
    grammar = HERMES.grammar([], is_required=False, is_parallel=True)
    assert accepts(compiler, grammar, "The weather is fine <tool_c, no call.")
    assert accepts(compiler, grammar, "<tool_response> is a tag, and so is </tool_call>.")
    assert not accepts(compiler, grammar, CALL_WEATHER)
    assert not accepts(compiler, grammar, f"Text first {CALL_WEATHER}")
    assert not accepts(compiler, grammar, "I'll write <tool_call> anyway")


# ---- the renderer ----------------------------------------------------------------------------


def output(text: str, new_text: str, finished: bool, reason: str = "stop") -> RequestOutput:
    return RequestOutput(
        request_id="r",
        prompt_token_ids=[1, 2, 3],
        token_ids=list(text.encode()),
        text=text,
        new_token_ids=list(new_text.encode()),
        new_text=new_text,
        finished=finished,
        finish_reason=reason if finished else None,
        num_cached_tokens=0,
        num_cached_tokens_by_tier=(0, 0, 0),
        arrival_time=0.0,
        first_token_time=0.0,
        finish_time=0.0 if finished else None,
        replica_index=0,
    )


def stream_chunks(renderer, index: int, text: str, step: int, reason: str = "stop") -> list[dict]:
    """The chunks ``renderer`` sends for ``text`` arriving ``step`` characters at a time."""
    chunks, done = [], 0
    for end in [*range(step, len(text), step), len(text)]:
        finished = end == len(text)
        chunk = renderer.chunk(index, output(text[:end], text[done:end], finished, reason))
        done = end
        if chunk is not None:
            chunks.append(json.loads(chunk.model_dump_json()))
    return chunks


def test_renderer_streams_call_deltas_and_answers_the_same_calls():
    text = f"Hm.{CALL_WEATHER}\n{CALL_TIME}"
    renderer = ToolChatRenderer("m", ByteTokenizer(), num_choices=2, tool_format=HERMES)
    chunks = []
    for index in range(2):  # two choices: ids never repeat across them
        chunks += stream_chunks(renderer, index, text, 7)
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert content == "Hm.Hm."
    entries = [c["choices"][0]["delta"].get("tool_calls", []) for c in chunks]
    assert all(len({e["index"] for e in chunk}) == len(chunk) for chunk in entries)
    deltas = [d for chunk in entries for d in chunk]
    firsts = [d for d in deltas if "id" in d]
    assert [(d["index"], d["type"], d["function"]["name"]) for d in firsts] == [
        (0, "function", "get_weather"),
        (1, "function", "get_time"),
    ] * 2
    assert len({d["id"] for d in firsts}) == 4
    assert all(d["id"].startswith("call_") and len(d["id"]) == 29 for d in firsts)
    later = [d for d in deltas if "id" not in d]
    assert all(
        set(d) == {"index", "function"} and set(d["function"]) == {"arguments"} for d in later
    )
    first_choice = deltas[: len(deltas) // 2]
    arguments = [
        "".join(d["function"]["arguments"] for d in first_choice if d["index"] == i) for i in (0, 1)
    ]
    assert arguments == ['{"city": "Paris"}', '{"zone": "CET"}']
    assert [
        c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]
    ] == [
        "tool_calls",
        "tool_calls",
    ]
    answer = renderer.response([(0, output(text, "", True)), (1, output("Plain.", "", True))], None)
    body = json.loads(answer.model_dump_json())
    first, second = body["choices"]
    assert first["finish_reason"] == "tool_calls" and first["message"]["content"] == "Hm."
    calls = first["message"]["tool_calls"]
    assert [(c["type"], c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("function", "get_weather", '{"city": "Paris"}'),
        ("function", "get_time", '{"zone": "CET"}'),
    ]
    assert second["finish_reason"] == "stop" and second["message"] == {
        "role": "assistant",
        "content": "Plain.",
    }
    cut = renderer.response([(0, output(CALL_WEATHER[:54], "", True, "length"))], None)
    message = cut.choices[0].message
    assert cut.choices[0].finish_reason == "length" and message.content is None
    assert message.tool_calls[0].function.arguments == '{"cit'


@pytest.mark.parametrize("step", [1, 3, 7, 200])
def test_a_chunk_holds_one_entry_per_call_with_the_header_and_first_arguments_together(step):
    """OpenAI's shape: clients that read the first entry of an index (instructor's partial
    streaming, llama-index) must not lose the arguments' first fragment."""
    text = f"{CALL_WEATHER}\n{CALL_TIME}"
    renderer = ToolChatRenderer("m", ByteTokenizer(), tool_format=HERMES)
    chunks = stream_chunks(renderer, 0, text, step)
    for chunk in chunks:
        entries = chunk["choices"][0]["delta"].get("tool_calls", [])
        assert len({e["index"] for e in entries}) == len(entries)
        for entry in entries:
            if "id" in entry:  # the first fragment rides with the header, when it was there
                arguments = entry["function"]["arguments"]
                assert arguments == "" or arguments.startswith("{")
    first_entries = {}  # what a client reading one entry per index per chunk gets
    for chunk in chunks:
        for entry in chunk["choices"][0]["delta"].get("tool_calls", []):
            first_entries.setdefault(entry["index"], []).append(entry["function"]["arguments"])
    assert ["".join(pieces) for pieces in first_entries.values()] == [
        '{"city": "Paris"}',
        '{"zone": "CET"}',
    ]
    if step == 200:  # one chunk: each call's header and whole arguments in one entry
        entries = chunks[0]["choices"][0]["delta"]["tool_calls"]
        assert [(e["function"]["name"], e["function"]["arguments"]) for e in entries] == [
            ("get_weather", '{"city": "Paris"}'),
            ("get_time", '{"zone": "CET"}'),
        ]


@pytest.mark.parametrize(
    "text, calls",
    [
        (
            f"{CALL_WEATHER}\n{CALL_TIME}\n<tool_call",
            [("get_weather", '{"city": "Paris"}'), ("get_time", '{"zone": "CET"}')],
        ),
        (f'{CALL_WEATHER}\n<tool_call>\n{{"name": "get_ti', [("get_weather", '{"city": "Paris"}')]),
        (
            f"{CALL_WEATHER}\n{CALL_TIME[:50]}",
            [("get_weather", '{"city": "Paris"}'), ("get_time", '{"zo')],
        ),
        ("<tool_c", []),
        ("Let me see <tool_ca", []),
    ],
)
def test_a_cut_output_never_leaks_markup_into_content(text, calls):
    """max_tokens cut the output (finish_reason length): the calls begun are kept (the last
    as far as it was written, as OpenAI answers), markup is never content, streamed or not."""
    renderer = ToolChatRenderer("m", ByteTokenizer(), tool_format=HERMES)
    answer = renderer.response([(0, output(text, "", True, "length"))], None)
    choice = answer.choices[0]
    expected_content = "Let me see " if text.startswith("Let") else None
    assert choice.finish_reason == "length"
    assert choice.message.content == (expected_content or ("" if not calls else None))
    got = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
    assert got == calls
    for step in (1, 4, 50):
        chunks = stream_chunks(renderer, 0, text, step, reason="length")
        streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
        assert streamed == (expected_content or "")
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        renderer = ToolChatRenderer("m", ByteTokenizer(), tool_format=HERMES)


def test_text_ending_like_a_tag_is_content_when_the_output_stopped():
    assert HERMES.parse("a <tool_c").content == "a <tool_c"
    assert HERMES.parse("a <tool_c", is_cut=True).content == "a "
