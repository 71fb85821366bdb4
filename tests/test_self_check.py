"""The start-up self-check: what the native path builds is compared with what the
running vLLM's constructors build (after other plugins patched them), and any
native part that cannot prove it builds the same steps aside for vLLM's own code,
with one WARNING and a counter. Outputs always equal stock vLLM's, in full
(`vars()` of every RequestOutput and CompletionOutput)."""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any

import pytest
from output_processor_support import ReqSpec, Side, add_to_both, new_iteration_stats, norm, norm_iteration_stats
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine import EngineCoreOutput, FinishReason
from vllm.v1.engine.output_processor import OutputProcessor as StockOP

from vllm_mmretry.output_processor import FORCE_SELF_CHECK_FAIL_ENV
from vllm_mmretry.output_processor import OutputProcessor as OurOP
from vllm_mmretry.vllm_adapter import v0_32

TEXT = "The quick brown fox jumps over the lazy dog. A cab of zzz, the end."
SPECS = [
    ReqSpec("d", "d", [1, 2, 3]),
    ReqSpec("c", "c", [1, 5], kind=RequestOutputKind.CUMULATIVE, stop=[" the"]),
    ReqSpec("f", "f", [1], kind=RequestOutputKind.FINAL_ONLY),
    ReqSpec("n", "n", [1, 7], n=2),
    ReqSpec("s", "s", [1], stream_interval=3),
]


def _run(tokenizer: Any, eco_cls: type = EngineCoreOutput, async_mode: bool = True,
         log_stats: bool = False, drain_every: int = 1) -> tuple[Any, list[Any], list[Any]]:
    """The same requests and engine outputs through stock vLLM and ours:
    (our processor, stock's outputs, ours), every output normalised in full
    (with `log_stats`, each step's IterationStats too). The collectors are
    drained every `drain_every` steps and at the end (a consumer that is behind
    leaves outputs to merge)."""
    stock, ours = (
        Side(StockOP(tokenizer, log_stats=log_stats), async_mode),
        Side(OurOP(tokenizer, log_stats=log_stats), async_mode, self_check_may_fail=True),
    )
    live, _ = add_to_both(stock, ours, SPECS)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    got_stock: list[Any] = []
    got_ours: list[Any] = []
    for step in range(0, len(ids), 2):
        last = step + 2 >= len(ids)
        for side, got in ((stock, got_stock), (ours, got_ours)):
            ecos = [
                eco_cls(
                    request_id=rid,
                    new_token_ids=list(ids[step : step + 2]),
                    finish_reason=FinishReason.LENGTH if last else None,
                )
                for rid in live
                if side.op.has_request(rid)
            ]
            its = new_iteration_stats() if log_stats else None
            outs, aborts = side.step(ecos, ts=2000.0 + 0.37 * step, stats=its)
            drained = side.drain() if last or (step // 2) % drain_every == 0 else {}
            got.append(([norm(o) for o in outs], sorted(aborts), {k: norm(v) for k, v in drained.items()},
                        norm_iteration_stats(its)))
    assert not ours.op.has_unfinished_requests()
    return ours.op, got_stock, got_ours


@pytest.fixture
def patch_outputs(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Another plugin's patch of RequestOutput / CompletionOutput.__init__."""

    def apply(ro_extra: Any, co_extra: Any) -> None:
        for cls, extra in ((RequestOutput, ro_extra), (CompletionOutput, co_extra)):
            init = cls.__init__

            @functools.wraps(init)
            def patched(self: Any, *args: Any, _init: Any = init, _extra: Any = extra, **kwargs: Any) -> None:
                _init(self, *args, **kwargs)
                _extra(self)

            monkeypatch.setattr(cls, "__init__", patched)

    return apply


def _warned(caplog: pytest.LogCaptureFixture, what: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and "turned off" in r.getMessage() and what in r.getMessage()
    ]


@pytest.mark.parametrize("async_mode", [True, False])
def test_plugin_attribute_on_outputs_is_carried_natively(
    tiny_tokenizer: Any, patch_outputs: Any, caplog: pytest.LogCaptureFixture, async_mode: bool
) -> None:
    def tag_ro(o: Any) -> None:
        o.plugin_trace = "trace-id"

    def tag_co(c: Any) -> None:
        c.plugin_score = 0.5

    patch_outputs(tag_ro, tag_co)
    op, stock, ours = _run(tiny_tokenizer, async_mode=async_mode)
    assert ours == stock
    assert "plugin_trace" in repr(ours) and "plugin_score" in repr(ours)
    c = op.counters()
    assert c["self_check_failed"] == {} and c["fast_steps"] > 0  # still the native path
    assert not _warned(caplog, "")


def test_plugin_attribute_derived_from_arguments_falls_back(
    tiny_tokenizer: Any, patch_outputs: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A patch whose value depends on the output's text cannot be templated: vLLM
    builds every output."""

    def tag_co(c: Any) -> None:
        c.text_chars = len(c.text)

    patch_outputs(lambda o: None, tag_co)
    op, stock, ours = _run(tiny_tokenizer)
    assert ours == stock and "text_chars" in repr(ours)
    c = op.counters()
    assert c["self_check_failed"] == {"outputs": 1}
    assert c["fast_steps"] == 0 and c["fallbacks"] == {"self_check_outputs": 6}
    assert _warned(caplog, "text_chars")


def test_fields_derived_from_whether_an_argument_is_set_fall_back(
    tiny_tokenizer: Any, patch_outputs: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A release (or plugin) deriving a field from `finished` or from `finish_reason is
    None`: the self-check's marks are all set and true, so only a construction with
    empty arguments shows it; vLLM then builds every output."""

    def status(o: Any) -> None:
        o.status = "finished" if o.finished else "running"

    def is_final(c: Any) -> None:
        c.is_final = c.finish_reason is not None

    patch_outputs(status, is_final)
    op, stock, ours = _run(tiny_tokenizer)
    assert ours == stock and "'running'" in repr(ours) and "'finished'" in repr(ours)
    c = op.counters()
    assert c["self_check_failed"] == {"outputs": 1}
    assert c["fast_steps"] == 0 and c["fallbacks"] == {"self_check_outputs": 6}
    assert _warned(caplog, "derived from the arguments: ['status']")


def test_engine_core_output_field_change_hands_requests_to_vllm(
    tiny_tokenizer: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A vLLM point release adding an EngineCoreOutput field, which may change what
    an output means (as 0.33's `error` did): slot reads are off and vLLM's code
    processes every request, outputs unchanged."""

    class ChangedEngineCoreOutput(EngineCoreOutput):  # msgspec appends the field
        new_point_release_field: int = 0

    monkeypatch.setattr(v0_32, "EngineCoreOutput", ChangedEngineCoreOutput)
    op, stock, ours = _run(tiny_tokenizer, eco_cls=ChangedEngineCoreOutput)
    assert ours == stock
    assert not op._core.fast_field_reads
    c = op.counters()
    assert c["self_check_failed"] == {"outputs": 1, "eco_offsets": 1}
    assert c["fast_steps"] == 0 and c["fallbacks"] == {"self_check_outputs": 6}
    assert len(_warned(caplog, "new_point_release_field")) == 2


@pytest.mark.parametrize("part", ["outputs", "eco_offsets", "detok", "objects", "stats", "merge"])
def test_forced_self_check_failure(
    tiny_tokenizer: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, part: str
) -> None:
    monkeypatch.setenv(FORCE_SELF_CHECK_FAIL_ENV, part)
    op, stock, ours = _run(tiny_tokenizer, log_stats=True, drain_every=3)
    assert ours == stock
    c = op.counters()
    assert c["self_check_failed"] == {part: 1}
    assert (c["native_stats_steps"] > 0) == (part not in ("stats", "outputs", "objects"))
    assert (c["native_merges"] > 0) == (part not in ("merge", "outputs", "objects"))
    assert len(_warned(caplog, f"forced by {FORCE_SELF_CHECK_FAIL_ENV}")) == 1
    assert op._core.fast_field_reads == (part != "eco_offsets")
    if part in ("outputs", "objects"):
        assert c["fast_steps"] == 0 and c["fallbacks"] == {f"self_check_{part}": 6}
    else:
        assert c["fast_steps"] > 0 and c["fallback_steps"] == 0
    if part == "detok":
        assert c["native_detok"] == 0 and c["python_detok"] == {"self_check": 6}
    else:
        assert c["native_detok"] == (0 if part in ("outputs", "objects") else 6)


@pytest.mark.parametrize("field", ["sent_tokens_offset", "weight_version_starts", "collector_ready"])
def test_request_object_name_mismatch_hands_requests_to_vllm(
    tiny_tokenizer: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, field: str
) -> None:
    """The adapter's name for an attribute the core writes or reads is not on the
    running vLLM's objects (a rename): every request runs vLLM's own loop, with
    outputs equal to stock's, one WARNING naming it and the counter."""
    renamed = f"{getattr(v0_32.OBJECT_FIELDS, field)}_v2"
    monkeypatch.setattr(v0_32, "OBJECT_FIELDS",
                        dataclasses.replace(v0_32.OBJECT_FIELDS, **{field: renamed}))
    op, stock, ours = _run(tiny_tokenizer)
    assert ours == stock
    c = op.counters()
    assert c["self_check_failed"] == {"objects": 1} and c["fast_steps"] == 0
    assert c["fallbacks"] == {"self_check_objects": 6}
    assert len(_warned(caplog, renamed)) == 1


def test_native_decode_stats_equal_stock(tiny_tokenizer: Any) -> None:
    """With statistics on, decode steps are recorded natively and every step's
    IterationStats (latencies, token counts, finished records) equals stock's."""
    op, stock, ours = _run(tiny_tokenizer, log_stats=True)
    assert ours == stock
    assert any(st is not None and "inter_token_latencies_iter', [0.74" in st for *_, st in ours)
    c = op.counters()
    assert c["self_check_failed"] == {} and c["native_stats_steps"] > 0


# A name another vLLM could use for something else (present, wrong meaning) and
# a name that is not there at all.
@pytest.mark.parametrize(("field", "renamed"), [
    ("stats_last_token_ts", "first_token_ts"),
    ("stats_num_generation_tokens", "num_preemptions"),
    ("iteration_inter_token_latencies", "time_to_first_tokens_iter"),
    ("iteration_num_generation_tokens", "num_generation_tokens_v2"),
])
def test_stats_name_mismatch_steps_aside(
    tiny_tokenizer: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
    field: str, renamed: str,
) -> None:
    """The adapter's name for a statistics attribute is wrong for the running
    vLLM: the start-up comparison with vLLM's update_from_output catches it, and
    vLLM's function records every step (same stats as stock), with one WARNING
    and the counter."""
    monkeypatch.setattr(v0_32, "OBJECT_FIELDS",
                        dataclasses.replace(v0_32.OBJECT_FIELDS, **{field: renamed}))
    op, stock, ours = _run(tiny_tokenizer, log_stats=True)
    assert ours == stock
    c = op.counters()
    assert c["self_check_failed"] == {"stats": 1}
    assert c["native_stats_steps"] == 0 and c["fast_steps"] > 0
    assert len(_warned(caplog, "decode-step statistics")) == 1


@pytest.mark.parametrize("async_mode", [True, False])
def test_native_merges_equal_stock(tiny_tokenizer: Any, async_mode: bool) -> None:
    """A consumer that takes outputs every third step: DELTA outputs of n = 1
    requests are merged natively into the one the collector holds (LLMEngine mode
    has no collectors), and every collected output equals stock's merged one."""
    op, stock, ours = _run(tiny_tokenizer, async_mode=async_mode, drain_every=3)
    assert ours == stock
    c = op.counters()
    assert c["self_check_failed"] == {}
    assert (c["native_merges"] > 0) == async_mode


def test_the_native_merge_leaves_another_completion_index_to_vllm(tiny_tokenizer: Any) -> None:
    """An output for another completion index is not merged natively (vLLM's `add`
    appends it as a second completion): the merge declines and touches nothing."""
    op = OurOP(tiny_tokenizer, log_stats=False)
    cur, nxt = v0_32._merge_pair(False, False, {})
    nxt.outputs[0].index = 1
    co = cur.outputs[0]
    before = (dict(vars(cur)), dict(vars(co)), list(co.token_ids))
    assert op._core.native_merge_outputs(cur, nxt) is False
    assert (vars(cur), vars(co), co.token_ids) == before
    assert cur.outputs == [co]
    nxt.outputs[0].index = 0  # the same pair with the index of the one held: merged
    assert op._core.native_merge_outputs(cur, nxt) is True
    assert co.token_ids == [1, 2, 3]


def _moved(field: str, src: str, dst: str) -> dict[str, tuple[str, ...]]:
    rules = v0_32.MERGE_FIELDS
    return {src: tuple(f for f in getattr(rules, src) if f != field),
            dst: (*getattr(rules, dst), field)}


# Merge rules another vLLM's add could have (a field merged another way, a field no
# longer merged, a renamed index): the start-up comparison with vLLM's add catches each.
@pytest.mark.parametrize("change", [
    _moved("stop_reason", "replaced", "kept_unless_none"),
    _moved("spec_decode_metrics", "kept_unless_none", "replaced"),
    _moved("kv_transfer_params", "ro_replaced", "ro_kept_unless_none"),
    {"replaced": tuple(f for f in v0_32.MERGE_FIELDS.replaced if f != "weight_versions")},
    {"concatenated": ("token_ids",), "extended": ("text",)},
    {"index": "index_v2"},
], ids=["stop_reason", "spec_decode_metrics", "kv_transfer_params", "weight_versions",
        "text_and_ids_swapped", "index"])
def test_merge_rule_mismatch_steps_aside(
    tiny_tokenizer: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
    change: dict[str, Any],
) -> None:
    monkeypatch.setattr(v0_32, "MERGE_FIELDS", dataclasses.replace(v0_32.MERGE_FIELDS, **change))
    op, stock, ours = _run(tiny_tokenizer, drain_every=3)
    assert ours == stock
    c = op.counters()
    assert c["self_check_failed"] == {"merge": 1}
    assert c["native_merges"] == 0 and c["fast_steps"] > 0
    assert len(_warned(caplog, "collector merges")) == 1


def test_shared_templates_are_instance_dicts(tiny_tokenizer: Any) -> None:
    """The templates every output copies hold the reference outputs' fields with the
    fast path's shared values, in the constructor's order, and live in an instance
    dict of vLLM's constructor (CPython shares its keys with the class's instances,
    so a copy per output copies only the values: a smaller dict than a plain copy)."""
    import sys

    check = v0_32.Adapter().self_check(tiny_tokenizer, None)
    ro, co = v0_32.shared_templates(check)
    want_ro = {**check.ro_base, "request_id": None, "prompt": None, "prompt_token_ids": None,
               "metrics": None, "lora_request": None, "outputs": None, "finished": False,
               "num_cached_tokens": 0, "num_cache_creation_tokens": 0}
    want_co = {**check.co_base, "index": 0, "text": "", "token_ids": None}
    for got, want in ((ro, want_ro), (co, want_co)):
        assert list(got.items()) == list(want.items())
        assert sys.getsizeof(got.copy()) < sys.getsizeof(dict(got))
    assert v0_32.shared_templates(check) == (ro, co)  # built once per self-check


@pytest.mark.parametrize("derived", ["num_cache_creation_tokens", "weight_versions"])
def test_a_plugin_attribute_derived_from_a_templated_field_falls_back(
        tiny_tokenizer: Any, patch_outputs: Any, derived: str) -> None:
    """Every field the native path fills is compared (RO_FILLED / CO_FILLED): a patch
    copying one of them into an attribute of its own is seen."""
    def copy_ro(o: Any) -> None:
        o.plugin_copy = o.num_cache_creation_tokens

    def copy_co(c: Any) -> None:
        c.plugin_copy = repr(c.weight_versions)

    if derived == "num_cache_creation_tokens":
        patch_outputs(copy_ro, lambda c: None)
    else:
        patch_outputs(lambda o: None, copy_co)
    op, stock, ours = _run(tiny_tokenizer)
    assert op.counters()["self_check_failed"] == {"outputs": 1}
    assert ours == stock


def test_a_failed_detokenizer_check_drops_the_native_vocabulary(
        tiny_tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FORCE_SELF_CHECK_FAIL_ENV, "detok")
    op = OurOP(tiny_tokenizer, log_stats=False)
    assert op._core.has_native_vocab is False and op._detok_reason == "self_check"
