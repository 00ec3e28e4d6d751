"""The base of every request body: fields it does not declare are dropped and their names kept
for the log (``ignored_fields``)."""

from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    ModelWrapValidatorHandler,
    PrivateAttr,
    model_validator,
)


class _Body(BaseModel):
    """A request body (or a part of one). Fields it does not declare are dropped, and their
    names kept for ``ignored_fields`` (the app logs them), as vLLM does: clients written for
    other servers send extensions of their own, which must not fail a request."""

    model_config = ConfigDict(extra="ignore", strict=True)
    _ignored: tuple[str, ...] = PrivateAttr(default=())

    @model_validator(mode="wrap")
    @classmethod
    def _note_ignored(cls, data: Any, handler: ModelWrapValidatorHandler) -> Any:
        body = handler(data)
        if isinstance(data, dict) and isinstance(body, _Body):
            known = _known_names(cls)
            body._ignored = tuple(str(key) for key in data if key not in known)
        return body


def _known_names(model: type[BaseModel]) -> frozenset[str]:
    names = set(model.model_fields)
    names.update(f.alias for f in model.model_fields.values() if f.alias is not None)
    return frozenset(names)


def ignored_fields(body: BaseModel, where: str = "") -> list[str]:
    """Dotted names of every field of ``body`` (and of the bodies inside it) that was given
    but is not served, e.g. ``["messages.0.audio", "foo"]``."""
    found = [f"{where}{name}" for name in getattr(body, "_ignored", ())]
    for name in type(body).model_fields:
        value = getattr(body, name)
        items = enumerate(value) if isinstance(value, list) else [(None, value)]
        for index, item in items:
            if isinstance(item, BaseModel):
                path = name if index is None else f"{name}.{index}"
                found += ignored_fields(item, f"{where}{path}.")
    return found
