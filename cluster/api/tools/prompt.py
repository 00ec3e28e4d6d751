"""The prompt of a chat with tools.

A chat template that reads a ``tools`` variable gets the tools, and the messages with their
``tool_calls`` and ``tool_call_id`` in Hugging Face's shape. A template that does not (SmolLM2's
concatenates ``message['content']``) gets messages rewritten as text in the tool format
(``hermes`` by default):

* the tools block starts the system message: put before an existing first system message's
  text, or sent as a new first system message;
* an assistant message's calls are written after its content, as the model writes them;
* consecutive tool messages become one user message of ``<tool_response>`` blocks.

The tools block comes before the conversation, so the turns of one conversation share it as
a prefix: the prompt of turn N (ending where the assistant's reply begins) is a prefix of the
prompt of turn N + 1 (which holds that reply), and its KV blocks are found in the prefix cache.
"""

from typing import Any

from cluster.api.tools.format import ToolFormat
from replicas.model.tokenizer import Tokenizer

_SYSTEM_ROLES = ("system", "developer")


def render_chat_prompt(
    tokenizer: Tokenizer,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    fmt: ToolFormat,
) -> str:
    """The prompt text of ``messages`` (``ChatMessage.to_template`` dicts) offering ``tools``
    (OpenAI's shape; None or empty: none offered). Raises what the template raises."""
    if tokenizer.chat_template_takes_tools:
        return tokenizer.apply_chat_template(messages, tools=tools or None)
    return tokenizer.apply_chat_template(messages_with_tools_as_text(messages, tools, fmt))


def messages_with_tools_as_text(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, fmt: ToolFormat
) -> list[dict[str, Any]]:
    """``messages`` with tools, calls and results written as text in ``fmt`` (new dicts; the
    given ones are left as they are). Without tools, calls or results: the messages as given."""
    rewritten: list[dict[str, Any]] = []
    for message in messages:
        role = message["role"]
        if role == "tool":
            content = message.get("content") or ""
            if rewritten and rewritten[-1].get("_results") is not None:
                rewritten[-1]["_results"].append(content)
            else:
                rewritten.append({"role": "user", "_results": [content]})
        elif role == "assistant" and message.get("tool_calls"):
            text = (message.get("content") or "") + fmt.render_calls(message["tool_calls"])
            rest = {k: v for k, v in message.items() if k not in ("tool_calls", "content")}
            rewritten.append({**rest, "content": text})
        else:
            rewritten.append(dict(message))
    for message in rewritten:
        results = message.pop("_results", None)
        if results is not None:
            message["content"] = fmt.render_results(results)
    if tools:
        block = fmt.system_prompt(tools)
        if rewritten and rewritten[0]["role"] in _SYSTEM_ROLES:
            first = rewritten[0]
            text = first.get("content") or ""
            first["content"] = f"{block}\n\n{text}" if text else block
        else:
            rewritten.insert(0, {"role": "system", "content": block})
    return rewritten
