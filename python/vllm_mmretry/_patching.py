"""Attribute patching that refuses to patch twice and can put everything back.

Kept apart from the patches themselves so tests can compare stock and patched
vLLM in one process (`restore_all`)."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_MARK = "__vllm_mmretry_original__"
# (owner, attribute) -> the original value, in patch order.
_originals: dict[tuple[Any, str], Any] = {}
# While `expecting` runs: label -> the signature each patched target must have.
_expected: dict[str, str] | None = None


class PatchError(RuntimeError):
    """A target was missing or already patched by someone else's copy of us."""


def label(owner: Any, name: str) -> str:
    """How a patch target is named: in log lines and as the key of the adapter's
    SIGNATURES table."""
    return f"{getattr(owner, '__name__', owner)}.{name}"


def patch_attr(owner: Any, name: str, new: Any) -> str:
    """Replace `owner.name` with `new`; return a label for the INFO line."""
    target = label(owner, name)
    if not hasattr(owner, name):
        raise PatchError(f"cannot patch {target}: it does not exist in this vLLM")
    current = getattr(owner, name)
    if (owner, name) in _originals or getattr(current, _MARK, None) is not None:
        raise PatchError(f"refusing to patch {target} twice")
    if _expected is not None:
        _check_signature(target, current, _expected)
    try:
        setattr(new, _MARK, current)
    except (AttributeError, TypeError):
        pass  # e.g. bound methods; the _originals entry still guards us
    _originals[(owner, name)] = current
    setattr(owner, name, new)
    return target


def is_patched(owner: Any, name: str) -> bool:
    return (owner, name) in _originals


def original(owner: Any, name: str) -> Any:
    """The value `owner.name` had before we patched it (or the current one)."""
    return _originals.get((owner, name), getattr(owner, name))


def restore_all() -> list[str]:
    """Undo every patch, newest first. Returns the labels restored."""
    restored = []
    for (owner, name), value in reversed(list(_originals.items())):
        setattr(owner, name, value)
        restored.append(label(owner, name))
    _originals.clear()
    return restored


class _Default:
    def __repr__(self) -> str:
        return "..."


def signature_of(obj: Any) -> str | None:
    """What a wrapper or a call relies on: parameter names, kinds and which have
    defaults (not annotations or default values). None for an object without one."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    params = [p.replace(annotation=p.empty, default=p.empty if p.default is p.empty else _Default())
              for p in sig.parameters.values()]
    return str(sig.replace(parameters=params, return_annotation=sig.empty))


def _check_signature(label: str, current: Any, expected: dict[str, str]) -> None:
    want = expected.get(label)
    if want is None:
        raise PatchError(f"cannot patch {label}: the adapter records no signature for it")
    found = signature_of(current)
    if found != want:
        raise PatchError(f"cannot patch {label}: its signature is {found}, "
                         f"the adapter was written against {want}")


@contextmanager
def expecting(signatures: dict[str, str]) -> Iterator[None]:
    """Patches made inside must replace targets with exactly these signatures."""
    global _expected
    _expected = signatures
    try:
        yield
    finally:
        _expected = None


def signature_problems(targets: dict[str, Any], signatures: dict[str, str]) -> list[str]:
    """Why each of `targets` (label -> object the adapter calls) differs from the
    signature recorded for it."""
    problems = []
    for label, obj in targets.items():
        try:
            _check_signature(label, obj, signatures)
        except PatchError as exc:
            problems.append(str(exc).replace("cannot patch", "cannot call", 1))
    return problems


def field_names(cls: Any) -> set[str]:
    """The fields a class declares: pydantic's, a dataclass's or msgspec's, else its
    constructor's parameters."""
    for declared in ("model_fields", "__dataclass_fields__", "__struct_fields__"):
        names = getattr(cls, declared, None)
        if names is not None:
            return set(names)
    try:
        return set(inspect.signature(cls).parameters)
    except (TypeError, ValueError):
        return set()


def field_problems(fields: dict[str, tuple[Any, tuple[str, ...]]]) -> list[str]:
    """Which fields the adapter reads (label -> (class, names)) the class lacks."""
    problems = []
    for label_, (cls, names) in fields.items():
        declared = field_names(cls)
        missing = [name for name in names if name not in declared]
        if missing:
            problems.append(f"cannot read {label_}.{', '.join(missing)}: not a field of "
                            "this vLLM's class")
    return problems
