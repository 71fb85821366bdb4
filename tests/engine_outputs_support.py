"""Engine-core messages decoded by vLLM and by the native reader, and compared in full
(the receive and decoder tests)."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import numpy as np
from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.serial_utils import MsgpackDecoder, UtilityResult

from vllm_mmretry import _core
from vllm_mmretry.receive import NativeOutputsDecoder, native_reader


def canon(v: Any) -> Any:
    """`v` in full, as nested tuples: every field of every struct, dataclass and
    result object, with each value's type."""
    if isinstance(v, msgspec.Struct):
        return (type(v).__name__, tuple((f, canon(getattr(v, f))) for f in v.__struct_fields__))
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return (type(v).__name__, tuple((f.name, canon(getattr(v, f.name))) for f in dataclasses.fields(v)))
    if isinstance(v, UtilityResult):
        return ("UtilityResult", canon(v.result))
    if isinstance(v, np.ndarray):
        return ("ndarray", str(v.dtype), v.shape, v.tobytes())
    if isinstance(v, (list, tuple)):
        return (type(v).__name__, tuple(canon(x) for x in v))
    if isinstance(v, (set, frozenset)):
        return (type(v).__name__, tuple(sorted(repr(canon(x)) for x in v)))
    if isinstance(v, dict):
        return ("dict", tuple((canon(k), canon(x)) for k, x in v.items()))
    return (type(v).__name__, repr(v))


def reader() -> _core.OutputsReader:
    r = native_reader()
    assert r is not None, "this vLLM's message layout is not the one the reader knows"
    return r


def outcome(decode: Any, frames: Any) -> tuple[Any, ...]:
    """What decoding gave, comparable in full (`canon`) and the object itself, or the
    exception's type and message."""
    try:
        v = decode(frames)
    except Exception as e:  # noqa: BLE001 - the exception is the answer compared
        return ("raised", type(e).__name__, str(e))
    return ("decoded", canon(v), v)


def decode_both(frames: Any) -> tuple[tuple[Any, ...], tuple[Any, ...], NativeOutputsDecoder]:
    """vLLM's answer and ours. The clock is stopped: a message without a timestamp gets
    `time.monotonic()` from EngineCoreOutputs.__post_init__, on either side."""
    ours = NativeOutputsDecoder(MsgpackDecoder(EngineCoreOutputs), reader())
    with stopped_clock():
        return (outcome(MsgpackDecoder(EngineCoreOutputs).decode, frames),
                outcome(ours.decode, frames), ours)


@contextlib.contextmanager
def stopped_clock() -> Iterator[None]:
    monotonic = time.monotonic
    time.monotonic = lambda: 12345.0
    try:
        yield
    finally:
        time.monotonic = monotonic
