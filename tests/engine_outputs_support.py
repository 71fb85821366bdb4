"""Engine-core messages compared in full, for the receive and decoder tests."""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec
import numpy as np
from vllm.v1.serial_utils import UtilityResult


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
