"""Where a chat's ``prompt_cache_breakpoint`` parts end, in prompt tokens.

A breakpoint marks the end of a text part of one message; the chat template decides where that
text lands in the rendered prompt. So the chat is rendered once more with a unique marker right
after each marked part, each marker's offset in the text is found and the markers are dropped;
the breakpoint's position is the number of tokens of the text before its marker, cut to the
tokens that text shares with the prompt itself (a tokenizer may merge across the boundary).
The KV cache keeps whole blocks only, so the position is floored to a block later
(``CacheHints.retained_blocks``).
"""

from collections.abc import Callable, Sequence
from typing import Any

_MARK = "\ue000strata-cache-breakpoint-{}\ue001"  # private-use characters: never in a prompt


def breakpoint_tokens(
    render: Callable[[list[dict[str, Any]]], str],
    encode: Callable[[str], list[int]],
    messages: Sequence[dict[str, Any]],
    breakpoints: Sequence[tuple[int, int, float | None]],
    token_ids: Sequence[int],
) -> list[tuple[int, float | None]]:
    """``(tokens, ttl_s)`` per breakpoint given as ``(message index, end offset in its content,
    ttl_s)``; a breakpoint the template drops (its marker is not rendered) is left out.
    ``render`` renders messages exactly as the prompt was rendered (template, tools),
    ``encode`` tokenizes text as the prompt was."""
    if not breakpoints:
        return []
    marked = [dict(message) for message in messages]
    # Insert from the highest offset down, so that earlier offsets of a message stay valid.
    order = sorted(range(len(breakpoints)), key=lambda i: breakpoints[i][:2], reverse=True)
    for i in order:
        index, end, _ = breakpoints[i]
        content = marked[index]["content"]
        marked[index]["content"] = content[:end] + _MARK.format(i) + content[end:]
    text = render(marked)
    found: list[tuple[int, int]] = []  # (offset in the marked text, breakpoint)
    for i in range(len(breakpoints)):
        offset = text.find(_MARK.format(i))
        if offset >= 0:
            found.append((offset, i))
    positions: list[tuple[int, float | None]] = []
    for offset, i in found:
        # Offsets were found in the marked text: drop the markers rendered before this one.
        before = text[:offset]
        for j in range(len(breakpoints)):
            before = before.replace(_MARK.format(j), "")
        prefix = encode(before)
        shared = 0
        for a, b in zip(prefix, token_ids):
            if a != b:
                break
            shared += 1
        positions.append((shared, breakpoints[i][2]))
    return positions
