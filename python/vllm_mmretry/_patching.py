"""Attribute patching that refuses to patch twice and can put everything back.

Kept apart from the patches themselves so tests can compare stock and patched
vLLM in one process (`restore_all`)."""

from __future__ import annotations

from typing import Any

_MARK = "__vllm_mmretry_original__"
# (owner, attribute) -> the original value, in patch order.
_originals: dict[tuple[Any, str], Any] = {}


class PatchError(RuntimeError):
    """A target was missing or already patched by someone else's copy of us."""


def patch_attr(owner: Any, name: str, new: Any) -> str:
    """Replace `owner.name` with `new`; return a label for the INFO line."""
    label = f"{getattr(owner, '__name__', owner)}.{name}"
    if not hasattr(owner, name):
        raise PatchError(f"cannot patch {label}: it does not exist in this vLLM")
    current = getattr(owner, name)
    if (owner, name) in _originals or getattr(current, _MARK, None) is not None:
        raise PatchError(f"refusing to patch {label} twice")
    try:
        setattr(new, _MARK, current)
    except (AttributeError, TypeError):
        pass  # e.g. bound methods; the _originals entry still guards us
    _originals[(owner, name)] = current
    setattr(owner, name, new)
    return label


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
        restored.append(f"{getattr(owner, '__name__', owner)}.{name}")
    _originals.clear()
    return restored
