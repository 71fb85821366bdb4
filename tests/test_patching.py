"""The patch helper (_patching.py): refuses to patch twice, also a target another copy
of the package patched, and, while the adapter's signatures are expected, a target the
adapter records no signature for."""

from __future__ import annotations

from typing import Any

import pytest

from vllm_mmretry import _patching, plugin


def test_a_target_another_copy_patched_is_refused() -> None:
    class Target:
        def f(self) -> int:
            return 1

    def theirs(self: Any) -> int:
        return 2

    setattr(theirs, _patching._MARK, Target.f)  # what the other copy's patch_attr leaves
    Target.f = theirs  # type: ignore[method-assign]
    with pytest.raises(_patching.PatchError, match=r"refusing to patch .*Target\.f twice"):
        _patching.patch_attr(Target, "f", lambda self: 3)
    assert not _patching.is_patched(Target, "f") and Target.f is theirs


def test_a_target_without_a_recorded_signature_is_refused() -> None:
    class Target:
        def f(self) -> int:
            return 1

    original = Target.f
    with _patching.expecting({}), pytest.raises(_patching.PatchError,
                                                match="records no signature"):
        _patching.patch_attr(Target, "f", lambda self: 3)
    assert not _patching.is_patched(Target, "f") and Target.f is original


def test_a_target_with_its_recorded_signature_is_patched_and_restored() -> None:
    class Target:
        def f(self, x: int, *, y: int = 0) -> int:
            return x

    # restore_all undoes every patch of the process: start from stock vLLM and leave
    # the plugin as it was found.
    registered = bool(plugin.active_patches())
    plugin.uninstall()
    original = Target.f
    label = _patching.label(Target, "f")
    try:
        with _patching.expecting({label: "(self, x, *, y=...)"}):
            assert _patching.patch_attr(Target, "f", lambda self, x, *, y=0: -x) == label
        assert Target().f(2) == -2 and _patching.original(Target, "f") is original
    finally:
        assert _patching.restore_all() == [label]
        if registered:
            plugin.register()
    assert Target.f is original
