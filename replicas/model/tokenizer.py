"""Tokenizers: a byte-level one for the built-in models and a wrapper of Hugging Face's."""

import functools
import json
from abc import ABC, abstractmethod
from datetime import datetime
from pathlib import Path
from typing import Any


class Tokenizer(ABC):
    @abstractmethod
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``, starting with BOS when the model uses one (unless
        ``add_special_tokens`` is False)."""

    @abstractmethod
    def decode(self, ids: list[int]) -> str:
        """Text of ``ids``, special tokens left out."""

    @property
    @abstractmethod
    def eos_token_ids(self) -> tuple[int, ...]: ...

    @property
    @abstractmethod
    def vocab_size(self) -> int: ...

    @abstractmethod
    def apply_chat_template(self, messages: list[dict[str, Any]]) -> str:
        """The prompt text for a chat, ending where the assistant's reply begins. A tokenizer
        whose ``chat_template_takes_tools`` is true also takes ``tools=`` (OpenAI's function
        tools), which its template renders."""

    @property
    def chat_template_takes_tools(self) -> bool:
        """Whether the chat template renders a ``tools`` variable (else tool definitions must
        be written into the messages by the caller)."""
        return False

    def info(self) -> dict[str, Any]:
        """What ``GET /tokenizer_info`` tells clients that tokenize for themselves."""
        return {"eos_token": None, "bos_token": None, "pad_token": None, "chat_template": None}


class ByteTokenizer(Tokenizer):
    """Ids 0-255 are the UTF-8 bytes of the text; 256 is BOS and 257 is EOS."""

    BOS = 256
    EOS = 257

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.BOS, *ids] if add_special_tokens else ids

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return (self.EOS,)

    @property
    def vocab_size(self) -> int:
        return 258

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> str:
        turns = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages)
        return turns + "<|assistant|>\n"


def _token_content(token: Any) -> str | None:
    """tokenizer_config.json writes special tokens as strings or as AddedToken dicts."""
    if isinstance(token, dict):
        return token.get("content")
    return token


class HFTokenizer(Tokenizer):
    """A Hugging Face ``tokenizers.Tokenizer`` with the settings that surround it.

    Built from a directory (``tokenizer.json`` and the ``tokenizer_config.json`` beside it) or,
    with ``from_tokenizer``, from a tokenizer object and explicit settings (as the GGUF loader
    does). BOS is added by the tokenizer's post-processor when it has one, or prepended when
    ``add_bos_token`` is set; a text that already starts with the BOS token (as rendered chat
    templates often do) does not get a second one.
    """

    def __init__(self, directory: str | Path, eos_token_ids: tuple[int, ...] = ()) -> None:
        from tokenizers import Tokenizer as RustTokenizer

        directory = Path(directory)
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"no tokenizer.json in {directory}")
        config_path = directory / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        self._setup(
            RustTokenizer.from_file(str(path)),
            bos_token=_token_content(config.get("bos_token")),
            eos_token=_token_content(config.get("eos_token")),
            add_bos_token=bool(config.get("add_bos_token", False)),
            eos_token_ids=eos_token_ids,
            chat_template=_pick_chat_template(config.get("chat_template"), directory),
        )

    @classmethod
    def from_tokenizer(
        cls,
        tokenizer: Any,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        add_bos_token: bool = False,
        eos_token_ids: tuple[int, ...] = (),
        chat_template: str | None = None,
    ) -> "HFTokenizer":
        """Wraps a ``tokenizers.Tokenizer``; ``bos_token`` and ``eos_token`` are token texts,
        ``eos_token_ids`` more ids that end generation besides ``eos_token``'s."""
        self = cls.__new__(cls)
        self._setup(
            tokenizer,
            bos_token=bos_token,
            eos_token=eos_token,
            add_bos_token=add_bos_token,
            eos_token_ids=eos_token_ids,
            chat_template=chat_template,
        )
        return self

    def _setup(
        self,
        tokenizer: Any,
        *,
        bos_token: str | None,
        eos_token: str | None,
        add_bos_token: bool,
        eos_token_ids: tuple[int, ...],
        chat_template: str | None,
    ) -> None:
        self._tokenizer = tokenizer
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id = self._id_of(bos_token)
        self._add_bos = add_bos_token and self.bos_token_id is not None
        eos_id = self._id_of(eos_token)
        eos = tuple(eos_token_ids) + (() if eos_id is None else (eos_id,))
        self._eos_token_ids = tuple(dict.fromkeys(eos))
        self.chat_template = chat_template

    @property
    def backend(self) -> Any:
        """The wrapped ``tokenizers.Tokenizer``."""
        return self._tokenizer

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._tokenizer.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        if not add_special_tokens:
            return ids
        bos = self.bos_token_id
        if self._add_bos and (not ids or ids[0] != bos):
            ids = [bos, *ids]
        if bos is not None and ids[:2] == [bos, bos]:
            ids = ids[1:]
        return ids

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=True)

    def info(self) -> dict[str, Any]:
        return {
            "eos_token": self.eos_token,
            "bos_token": self.bos_token,
            "pad_token": None,
            "chat_template": self.chat_template,
        }

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos_token_ids

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def chat_template_takes_tools(self) -> bool:
        return self.chat_template is not None and _takes_tools(self.chat_template)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> str:
        if self.chat_template is None:
            raise ValueError("this model has no chat template; send a plain completion instead")
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.filters["tojson"] = lambda value, indent=None: json.dumps(
            value, indent=indent, ensure_ascii=False
        )
        return env.from_string(self.chat_template).render(
            messages=messages,
            add_generation_prompt=True,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **({} if tools is None else {"tools": tools}),
        )


@functools.lru_cache(maxsize=8)
def _takes_tools(template: str) -> bool:
    """Whether ``template`` reads a ``tools`` variable (parsed once per template)."""
    from jinja2 import meta
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    parsed = ImmutableSandboxedEnvironment().parse(template)
    return "tools" in meta.find_undeclared_variables(parsed)


def _pick_chat_template(template: Any, directory: Path) -> str | None:
    """The default template from tokenizer_config.json, or chat_template.jinja beside it."""
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default")
    if template is None and (directory / "chat_template.jinja").is_file():
        template = (directory / "chat_template.jinja").read_text()
    return template
