"""`python/vllm_mmretry/_core.pyi` describes the compiled `vllm_mmretry._core`: the same
module names, classes, methods and attributes, and the same parameters (names,
kinds, defaults) wherever PyO3 records a `__text_signature__`. Run against the
built extension, so a Rust change without its stub change fails here."""

from __future__ import annotations

import ast
import inspect
import pathlib
import subprocess
import sys
from typing import Any

import pytest

from vllm_mmretry import _core

STUB = pathlib.Path(__file__).resolve().parents[1] / "python" / "vllm_mmretry" / "_core.pyi"
# Inherited from `object` or added by Python/PyO3 to every class: not the stub's business.
IMPLICIT = {"__new__", "__doc__", "__module__", "__dict__", "__weakref__", "__init__"}
CONSTRUCTORS = ("__new__", "__init__")

Param = tuple[str, str, Any]  # (name, kind, default or inspect.Parameter.empty)


def _stub_tree() -> ast.Module:
    return ast.parse(STUB.read_text())


def _stub_params(fn: ast.FunctionDef, method: bool) -> list[Param]:
    a = fn.args
    empty = inspect.Parameter.empty
    positional = a.posonlyargs + a.args
    pos_defaults: list[Any] = [empty] * (len(positional) - len(a.defaults)) + [
        ast.literal_eval(d) for d in a.defaults]
    params: list[Param] = []
    for arg, default in zip(positional, pos_defaults, strict=True):
        kind = "POSITIONAL_ONLY" if arg in a.posonlyargs else "POSITIONAL_OR_KEYWORD"
        params.append((arg.arg, kind, default))
    if a.vararg:
        params.append((a.vararg.arg, "VAR_POSITIONAL", empty))
    for arg, kw_default in zip(a.kwonlyargs, a.kw_defaults, strict=True):
        params.append((arg.arg, "KEYWORD_ONLY",
                       empty if kw_default is None else ast.literal_eval(kw_default)))
    if a.kwarg:
        params.append((a.kwarg.arg, "VAR_KEYWORD", empty))
    is_static = fn.name != "__new__" and any(
        isinstance(d, ast.Name) and d.id == "staticmethod" for d in fn.decorator_list)
    return params[1:] if method and not is_static else params  # drop self / cls


def _runtime_params(obj: Any) -> list[Param] | None:
    if getattr(obj, "__text_signature__", None) is None:
        return None
    sig = inspect.signature(obj)
    return [(p.name, p.kind.name, p.default) for p in sig.parameters.values()
            if p.name not in ("self", "$self", "$type")]


def _stub_classes() -> dict[str, ast.ClassDef]:
    return {n.name: n for n in _stub_tree().body if isinstance(n, ast.ClassDef)}


def _runtime_classes() -> dict[str, type]:
    return {n: o for n, o in vars(_core).items() if isinstance(o, type) and not n.startswith("_")}


def test_module_level_names_match() -> None:
    tree = _stub_tree()
    stub = {n.name for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef))}
    stub |= {n.target.id for n in tree.body
             if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    runtime = {n for n in vars(_core) if not n.startswith("_") or n == "__version__"}
    assert stub == runtime


@pytest.mark.parametrize("name", sorted(_runtime_classes()))
def test_class_members_match(name: str) -> None:
    cls = _runtime_classes()[name]
    node = _stub_classes()[name]
    stub_methods = {n.name for n in node.body if isinstance(n, ast.FunctionDef)} - IMPLICIT
    stub_attrs = {n.target.id for n in node.body
                  if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    members = {m: v for m, v in vars(cls).items() if m not in IMPLICIT}
    attrs = {m for m, v in members.items() if inspect.isgetsetdescriptor(v)}
    methods = set(members) - attrs
    assert stub_attrs == attrs
    assert stub_methods == methods


def _signature_cases() -> list[tuple[str, str]]:
    cases = [(f"{cls}.{fn.name}", fn.name) for cls, node in _stub_classes().items()
             for fn in node.body if isinstance(fn, ast.FunctionDef)]
    cases += [(fn.name, fn.name) for fn in _stub_tree().body if isinstance(fn, ast.FunctionDef)]
    return cases


@pytest.mark.parametrize("qualname", [q for q, _ in _signature_cases()])
def test_signatures_match_text_signature(qualname: str) -> None:
    owner_name, _, fn_name = qualname.rpartition(".")
    if owner_name:
        node = next(f for f in _stub_classes()[owner_name].body
                    if isinstance(f, ast.FunctionDef) and f.name == fn_name)
        method = True
        owner = getattr(_core, owner_name)
        # A class records its constructor's signature on itself.
        runtime = _runtime_params(owner if fn_name in CONSTRUCTORS else getattr(owner, fn_name))
    else:
        node = next(f for f in _stub_tree().body
                    if isinstance(f, ast.FunctionDef) and f.name == fn_name)
        runtime = _runtime_params(getattr(_core, fn_name))
        method = False
    if runtime is None:
        pytest.skip(f"{qualname}: no __text_signature__ at runtime")
    assert _stub_params(node, method) == runtime


def test_every_runtime_callable_with_a_signature_is_checked() -> None:
    checked = {q for q, _ in _signature_cases()}
    for name, cls in _runtime_classes().items():
        for member, value in vars(cls).items():
            if member in IMPLICIT or inspect.isgetsetdescriptor(value):
                continue
            assert f"{name}.{member}" in checked
        if cls.__text_signature__ is not None:  # type: ignore[attr-defined]
            assert f"{name}.__new__" in checked


def test_mypy_stubtest_agrees() -> None:
    """mypy's own stub checker (types it can see at runtime: finality, __new__ vs
    __init__, __all__, defaults) reports nothing."""
    proc = subprocess.run([sys.executable, "-m", "mypy.stubtest", "vllm_mmretry._core",
                           "--mypy-config-file", str(STUB.parents[2] / "pyproject.toml")],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
