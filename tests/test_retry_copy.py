"""The retry keeps a deep copy of each request it covers (`retry._copy`). It must be
what pydantic's `model_copy(deep=True)` gives: equal, and sharing with the original
exactly the objects pydantic's copy shares (atoms), so that rendering's in-place
adjustments of the request cannot reach the retained source. Compared on
hypothesis-generated chat, completion and embedding request bodies, validated by
vLLM's own request classes."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError

from vllm_mmretry import retry

_text = st.text(max_size=12)
_json_leaf = st.none() | st.booleans() | st.integers(-5, 5) | st.floats(allow_nan=False) | _text
_json = st.recursive(_json_leaf, lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(_text, inner, max_size=3), max_leaves=8)
_part = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": _text}),
    st.fixed_dictionaries({"type": st.just("image_url"),
                           "image_url": st.fixed_dictionaries({"url": _text})}),
)
_message = st.fixed_dictionaries({
    "role": st.sampled_from(["user", "system", "assistant"]),
    "content": _text | st.lists(_part, min_size=1, max_size=3),
})
_tool = st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": st.from_regex(r"[a-z]{1,6}", fullmatch=True),
     "parameters": st.just({"type": "object"})})})
_sampling = {
    "max_tokens": st.integers(1, 64),
    "temperature": st.floats(0, 2),
    "stop": _text | st.lists(_text, max_size=3),
    "logit_bias": st.dictionaries(st.integers(0, 99).map(str), st.floats(-5, 5), max_size=3),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "seed": st.integers(0, 99),
    "an_extra_field": _json,  # OpenAI requests allow extra fields (kept as extra)
}


def _body(required: dict[str, Any], **optional: Any) -> st.SearchStrategy[dict[str, Any]]:
    # Streaming, as vLLM accepts `stream_options` only then.
    return st.fixed_dictionaries({"model": st.just("m"), "stream": st.just(True), **required},
                                 optional={**_sampling, **optional})  # type: ignore[arg-type]


def _chat_request(body: dict[str, Any]) -> BaseModel:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    return ChatCompletionRequest.model_validate(body)


def _completion_request(body: dict[str, Any]) -> BaseModel:
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    return CompletionRequest.model_validate(body)


def _embedding_chat_request(body: dict[str, Any]) -> BaseModel:
    from vllm.entrypoints.pooling.embed.protocol import EmbeddingChatRequest

    return EmbeddingChatRequest.model_validate(
        {k: v for k, v in body.items() if k in ("model", "messages", "seed", "an_extra_field")})


_KINDS = {
    "chat": (_chat_request, _body({"messages": st.lists(_message, min_size=1, max_size=3)},
                                  tools=st.lists(_tool, min_size=1, max_size=2))),
    "completion": (_completion_request, _body({"prompt": st.text(min_size=1, max_size=12)
                                               | st.lists(st.integers(0, 99), min_size=1,
                                                          max_size=5)})),
    "embedding_chat": (_embedding_chat_request, _body(
        {"messages": st.lists(_message, min_size=1, max_size=2)})),
}


def _shared(original: Any, copied: Any, path: str = "") -> set[str]:
    """Paths where `copied` holds the very object `original` holds."""
    out = {path} if copied is original else set()
    if isinstance(original, BaseModel) and isinstance(copied, BaseModel):
        pairs = [("__dict__", original.__dict__, copied.__dict__),
                 ("__pydantic_extra__", original.__pydantic_extra__, copied.__pydantic_extra__),
                 ("__pydantic_private__", original.__pydantic_private__,
                  copied.__pydantic_private__)]
        for name, a, b in pairs:
            out |= _shared(a, b, f"{path}.{name}")
    elif isinstance(original, dict) and isinstance(copied, dict):
        for key in original.keys() & copied.keys():
            out |= _shared(original[key], copied[key], f"{path}[{key!r}]")
    elif isinstance(original, (list, tuple)) and isinstance(copied, (list, tuple)):
        for i, (a, b) in enumerate(zip(original, copied, strict=False)):
            out |= _shared(a, b, f"{path}[{i}]")
    return out


def _assert_like_pydantic_deep_copy(request: BaseModel) -> None:
    ours, pydantics = retry._copy(request), request.model_copy(deep=True)
    assert type(ours) is type(request)
    assert ours == pydantics == request
    assert ours.__pydantic_fields_set__ == request.__pydantic_fields_set__
    assert ours.__pydantic_fields_set__ is not request.__pydantic_fields_set__
    assert _shared(request, ours) == _shared(request, pydantics)


@pytest.mark.parametrize("kind", sorted(_KINDS))
def test_the_retained_request_is_pydantics_deep_copy(kind: str) -> None:
    build, bodies = _KINDS[kind]

    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(bodies)
    def check(body: dict[str, Any]) -> None:
        try:
            request = build(body)
        except (ValidationError, ValueError):
            assume(False)
            return
        _assert_like_pydantic_deep_copy(request)

    check()


def test_a_change_to_the_copy_does_not_reach_the_source() -> None:
    request = _chat_request({"model": "m", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
        "an_extra_field": {"k": [1]}})
    source = retry._copy(request)
    request.messages[0]["content"][0]["text"] = "adjusted"  # as a tool parser might
    request.tools[0].function.name = "g"
    request.__pydantic_extra__["an_extra_field"]["k"].append(2)
    assert source.messages[0]["content"][0]["text"] == "hi"
    assert source.tools[0].function.name == "f"
    assert source.__pydantic_extra__["an_extra_field"] == {"k": [1]}


def test_values_shared_between_fields_stay_shared_in_the_copy() -> None:
    # As in pydantic's deep copy (one memo): a value two fields hold is copied once.
    request = _chat_request({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    shared = [{"k": 1}]
    request.__pydantic_extra__["first"] = shared
    request.__pydantic_extra__["second"] = shared
    request.__dict__["stop"] = shared
    copied = retry._copy(request)
    assert copied.__pydantic_extra__["first"] is copied.__pydantic_extra__["second"]
    assert copied.__pydantic_extra__["first"] is copied.__dict__["stop"]
    assert copied.__dict__["stop"] is not shared
    _assert_like_pydantic_deep_copy(request)


class _OwnDeepCopy(BaseModel):
    values: list[int]
    copies: int = 0

    def __deepcopy__(self, memo: dict[int, Any] | None = None) -> _OwnDeepCopy:
        return _OwnDeepCopy(values=copy.deepcopy(self.values, memo), copies=self.copies + 1)


def test_a_model_with_its_own_copy_is_copied_by_its_own_method() -> None:
    copied = retry._copy(_OwnDeepCopy(values=[1, 2]))
    assert copied.copies == 1


def test_an_object_that_is_not_a_model_is_deep_copied() -> None:
    source = {"messages": [{"content": "hi"}]}
    copied = retry._copy(source)
    assert copied == source and copied["messages"][0] is not source["messages"][0]
