"""Differential suite for the two stock paths the main suite does not drive:

1. Streaming input (resumable requests), the way AsyncLLM's
   `_add_streaming_input_request` drives the output processor: every input
   chunk is an `add_request(resumable=True)` with the same internal id, the end
   of the input stream one non-resumable add (prompt [0], no text). Chunks
   arrive before or after the engine finished the current sub-request; the end
   arrives while a sub-request runs, while chunks are queued, or when the engine
   already finished (stock then puts STREAM_FINISHED into the collector).
2. Weight versions other than "default" changing mid-request
   (`CompletionOutput.weight_versions` on finish), on the native fast path,
   the Python detokenizer and the per-request Python path (logprobs).

Stock vLLM's OutputProcessor and ours get the same calls (engine outputs built
twice: the processors mutate them); outputs, collector contents, counts and
iteration stats must match after every step. Native detokenizer on and off."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from output_processor_support import (
    ENGINE_ERRORS,
    ReqSpec,
    Side,
    add_to_both,
    eco,
    engine_request,
    error_kw,
    new_iteration_stats,
    norm,
    norm_iteration_stats,
    streaming_input_collector,
)
from vllm.outputs import STREAM_FINISHED, WeightVersionSpan
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine import EngineCoreRequest, FinishReason
from vllm.v1.engine.output_processor import OutputProcessor as StockOP

from vllm_mmretry.output_processor import OutputProcessor as OurOP

TEXT = "The quick brown fox jumps over the lazy dog.\nA cab of zzz, the end. café 東京"
VERSIONS = [None, "default", "v1", "v2"]
SUB_FINISH = [None] * 2 + [FinishReason.LENGTH, FinishReason.STOP]

SETTINGS = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.fixture(scope="module")
def stream_and_vocab(tiny_tokenizer: Any) -> tuple[Any, list[int], list[int]]:
    stream = tiny_tokenizer.encode(TEXT, add_special_tokens=False)
    vocab = sorted(set(stream)) + sorted(set(tiny_tokenizer.all_special_ids))[:2]
    return tiny_tokenizer, stream, vocab


def norm_item(o: Any) -> Any:
    # generate() tells the end-of-stream marker apart by identity.
    return "STREAM_FINISHED" if o is STREAM_FINISHED else norm(o)


def peek(side: Side) -> dict[str, Any]:
    """Collector contents without taking them (merging continues)."""
    return {rid: norm_item(q.output) for rid, q in side.collectors.items() if q.output is not None}


def drain(side: Side) -> dict[str, Any]:
    return {rid: norm_item(o) for rid, o in side.drain().items()}


def chunk_request(spec: ReqSpec, prompt_ids: list[int], arrival: float, resumable: bool) -> EngineCoreRequest:
    """One AsyncLLM input-stream add: same internal id every time."""
    req = engine_request(ReqSpec(**{**spec.__dict__, "prompt_ids": prompt_ids}), arrival=arrival)
    req.resumable = resumable
    return req


def make_sides(tokenizer: Any, native: bool, async_mode: bool, log_stats: bool, interval: int) -> tuple[Side, Side]:
    stock = Side(StockOP(tokenizer, log_stats=log_stats, stream_interval=interval), async_mode)
    ours = Side(OurOP(tokenizer, log_stats=log_stats, stream_interval=interval, native_detok=native), async_mode)
    return stock, ours


def compare_counts(stock: Side, ours: Side, ids: list[str]) -> None:
    assert ours.op.get_num_unfinished_requests() == stock.op.get_num_unfinished_requests()
    assert ours.op.has_unfinished_requests() == stock.op.has_unfinished_requests()
    assert ours.op.get_num_queued_tokens() == stock.op.get_num_queued_tokens()
    for rid in ids:
        assert ours.op.has_request(rid) == stock.op.has_request(rid), rid


@pytest.mark.parametrize("native", [True, False], ids=["native_detok", "python_detok"])
@settings(SETTINGS, max_examples=250)
@given(data=st.data())
def test_streaming_input_same_as_stock(
    stream_and_vocab: tuple[Any, list[int], list[int]], native: bool, data: st.DataObject
) -> None:
    tokenizer, stream, vocab = stream_and_vocab
    async_mode = data.draw(st.booleans(), label="async_mode")
    log_stats = data.draw(st.booleans(), label="log_stats")
    interval = data.draw(st.sampled_from([1, 1, 2]), label="engine_stream_interval")
    stock, ours = make_sides(tokenizer, native, async_mode, log_stats, interval)

    # Streaming sessions (AsyncLLM allows n=1, no FINAL_ONLY, no stop strings)
    # next to ordinary requests sharing the processor.
    specs: list[ReqSpec] = []
    for i in range(data.draw(st.integers(1, 2), label="num_sessions")):
        specs.append(
            ReqSpec(
                request_id=f"s{i}",
                external_id=data.draw(st.sampled_from([f"ext-s{i}", "shared"])),
                prompt_ids=[],
                kind=data.draw(st.sampled_from([RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE])),
                stream_interval=data.draw(st.sampled_from([None, None, 2])),
                logprobs=data.draw(st.sampled_from([None, None, 1])),
                min_tokens=data.draw(st.sampled_from([0, 0, 2])),
                stop_token_ids=data.draw(st.sampled_from([None, vocab[:2]])),
            )
        )
    plain = [
        ReqSpec(
            request_id=f"p{i}",
            external_id=data.draw(st.sampled_from([f"ext-p{i}", "shared"])),
            prompt_ids=[vocab[i]],
            kind=data.draw(st.sampled_from(list(RequestOutputKind))),
        )
        for i in range(data.draw(st.integers(0, 1), label="num_plain"))
    ]
    all_ids = [s.request_id for s in specs + plain]
    externals = sorted({s.external_id for s in specs + plain})

    # Engine-side model of each session: is a sub-request running, how many
    # chunks wait behind it, has the input stream ended.
    running = {s.request_id: False for s in specs}
    pending = {s.request_id: 0 for s in specs}
    closed = {s.request_id: False for s in specs}
    gone: set[str] = set()
    cursor = {rid: data.draw(st.integers(0, len(stream) - 1)) for rid in all_ids}
    clock = [1000.0]

    def add_both(req_of: Any, prompt: str | None, spec: ReqSpec) -> None:
        for side in (stock, ours):
            if spec.request_id not in side.collectors and side.async_mode:
                side.collectors[spec.request_id] = streaming_input_collector(spec.kind, spec.request_id)
            side.op.add_request(req_of(), prompt, None, 0, side.collectors.get(spec.request_id))

    for spec in plain:
        assert stock.add(spec) == ours.add(spec)

    def add_chunk(spec: ReqSpec) -> None:
        rid = spec.request_id
        ids = data.draw(st.lists(st.sampled_from(vocab), min_size=1, max_size=4))
        text = data.draw(st.one_of(st.none(), st.just(""), st.sampled_from(["more ", "text", "東京"])))
        clock[0] += 1.0
        add_both(lambda: chunk_request(spec, ids, clock[0], True), text, spec)
        if running[rid]:
            pending[rid] += 1
        else:
            running[rid] = True

    for spec in specs:  # the first chunk goes in at once (AsyncLLM's input task)
        add_chunk(spec)

    for _ in range(data.draw(st.integers(1, 16), label="num_actions")):
        sessions = [s for s in specs if s.request_id not in gone and not closed[s.request_id]]
        action = data.draw(st.sampled_from(["chunk"] * 2 + ["end", "step", "step", "finish", "finish", "abort"]))
        if action in ("chunk", "end") and not sessions:
            action = "step"
        if action == "chunk":
            add_chunk(data.draw(st.sampled_from(sessions)))
        elif action == "end":
            spec = data.draw(st.sampled_from(sessions))
            rid = spec.request_id
            add_both(lambda spec=spec: chunk_request(spec, [0], clock[0], False), None, spec)
            closed[rid] = True
            if not running[rid] and pending[rid] == 0:
                gone.add(rid)  # engine already finished: stock ends it here
        elif action == "abort":
            internal = data.draw(st.booleans())
            pool = (all_ids if internal else externals) + ["unknown"]
            ids = data.draw(st.lists(st.sampled_from(pool), min_size=1, max_size=2, unique=True))
            a = stock.op.abort_requests(list(ids), internal=internal)
            b = ours.op.abort_requests(list(ids), internal=internal)
            assert b == a
            gone |= set(a)
        else:
            # "finish": one running session's sub-request ends in this step.
            plan = []
            live = [r for r in all_ids if r not in gone and (r not in running or running[r])]
            ending = data.draw(st.sampled_from(live)) if action == "finish" and live else None
            for rid in [r for r in live if r == ending or data.draw(st.booleans())]:
                k = data.draw(st.integers(0, 4))
                toks = [stream[(cursor[rid] + j) % len(stream)] for j in range(k)]
                cursor[rid] += k
                # A session's sub-request ends with STOP/LENGTH, or ERROR (engine aborts
                # send nothing); vLLM 0.33 ends the session on ERROR, 0.32 does not.
                fin = data.draw(
                    st.sampled_from(
                        [*SUB_FINISH[2:], FinishReason.ERROR]
                        if rid == ending
                        else SUB_FINISH + ([] if rid in running else [FinishReason.ABORT])
                    )
                )
                if fin is not None and fin != FinishReason.ABORT and not toks:
                    toks = [vocab[0]]
                err = data.draw(st.sampled_from([None] * 6 + ENGINE_ERRORS)) if ENGINE_ERRORS else None
                if err is not None:  # rejected by the engine (e.g. paused): nothing ran
                    toks, fin = [], FinishReason.ERROR
                plan.append((rid, toks, fin, err))
                if fin is None:
                    continue
                if rid in running and not (closed[rid] and pending[rid] == 0):
                    # Sub-request done; the engine starts the next queued chunk.
                    if pending[rid]:
                        pending[rid] -= 1
                    else:
                        running[rid] = False
                else:
                    gone.add(rid)
            if data.draw(st.booleans()):
                plan.append(("unknown", [vocab[0]], None, None))
            spec_of = {s.request_id: s for s in specs + plain}

            def build(plan: list = plan, spec_of: dict = spec_of) -> list:
                return [
                    eco(r, t, f, logprobs=spec_of[r].logprobs if r in spec_of else None, **error_kw(e))
                    for r, t, f, e in plan
                ]

            wv = data.draw(st.sampled_from(VERSIONS), label="weight_version")
            its_a = new_iteration_stats() if log_stats else None
            its_b = new_iteration_stats() if log_stats else None
            outs_a, abort_a = stock.step(build(), stats=its_a, weight_version=wv)
            outs_b, abort_b = ours.step(build(), stats=its_b, weight_version=wv)
            assert [norm(o) for o in outs_b] == [norm(o) for o in outs_a]
            assert abort_b == abort_a
            assert norm_iteration_stats(its_b) == norm_iteration_stats(its_a)
            # Sessions the processor ended (ERROR on 0.33, rejected by the engine).
            gone |= {r for r in running if not stock.op.has_request(r)}
        assert peek(ours) == peek(stock)
        if data.draw(st.booleans(), label="drain"):
            assert drain(ours) == drain(stock)
        compare_counts(stock, ours, all_ids)
    a = stock.op.abort_requests(externals, internal=False)
    assert ours.op.abort_requests(externals, internal=False) == a
    assert drain(ours) == drain(stock)
    compare_counts(stock, ours, all_ids)
    assert ours.op.get_num_unfinished_requests() == 0


@pytest.mark.parametrize("native", [True, False], ids=["native_detok", "python_detok"])
@SETTINGS
@given(data=st.data())
def test_weight_versions_same_as_stock(
    stream_and_vocab: tuple[Any, list[int], list[int]], native: bool, data: st.DataObject
) -> None:
    tokenizer, stream, vocab = stream_and_vocab
    async_mode = data.draw(st.booleans(), label="async_mode")
    stock, ours = make_sides(tokenizer, native, async_mode, False, data.draw(st.sampled_from([1, 2])))
    specs = [
        ReqSpec(
            request_id=f"r{i}",
            external_id=f"e{i}",
            prompt_ids=[vocab[i]],
            n=data.draw(st.sampled_from([1, 1, 2])),
            kind=data.draw(st.sampled_from(list(RequestOutputKind))),
            stop=data.draw(st.sampled_from([None, None, ["fox"], [" the"]])),
            include_stop=data.draw(st.booleans()),
            stream_interval=data.draw(st.sampled_from([None, 2])),
            logprobs=data.draw(st.sampled_from([None, None, 0])),
            min_tokens=data.draw(st.sampled_from([0, 2])),
            detokenize=data.draw(st.sampled_from([True, True, False])),
        )
        for i in range(data.draw(st.integers(1, 3), label="num_requests"))
    ]
    live, logprobs_of = add_to_both(stock, ours, specs)
    cursor = {rid: data.draw(st.integers(0, len(stream) - 1)) for rid in live}
    wv: str | None = "default"
    for _ in range(data.draw(st.integers(1, 10), label="num_steps")):
        if data.draw(st.booleans()):
            wv = data.draw(st.sampled_from(VERSIONS), label="weight_version")
        plan = []
        for rid in [r for r in live if data.draw(st.booleans())]:
            k = data.draw(st.integers(0, 4))
            toks = [stream[(cursor[rid] + j) % len(stream)] for j in range(k)]
            cursor[rid] += k
            fin = data.draw(st.sampled_from([None] * 4 + [FinishReason.LENGTH, FinishReason.ABORT]))
            if fin == FinishReason.LENGTH and not toks:
                toks = [vocab[0]]
            plan.append((rid, toks, fin))

        def build(plan: list = plan) -> list:
            return [eco(r, t, f, logprobs=logprobs_of[r]) for r, t, f in plan]

        outs_a, abort_a = stock.step(build(), weight_version=wv)
        outs_b, abort_b = ours.step(build(), weight_version=wv)
        assert [norm(o) for o in outs_b] == [norm(o) for o in outs_a]
        assert abort_b == abort_a
        assert peek(ours) == peek(stock)
        if data.draw(st.booleans(), label="drain"):
            assert drain(ours) == drain(stock)
        done = set(abort_a) | {r for r, _, f in plan if f is not None}
        live = [r for r in live if r not in done]
        compare_counts(stock, ours, live)
    externals = [s.external_id for s in specs]
    assert ours.op.abort_requests(externals, internal=False) == stock.op.abort_requests(externals, internal=False)
    assert drain(ours) == drain(stock)


@pytest.mark.parametrize("native", [True, False], ids=["native_detok", "python_detok"])
@pytest.mark.parametrize("logprobs", [None, 0], ids=["fast_path", "python_path"])
def test_weight_version_change_gives_spans(tiny_tokenizer: Any, native: bool, logprobs: int | None) -> None:
    """Explicit spans (not only "same as stock"): the version changes twice
    mid-request, one step reports none."""
    ids = tiny_tokenizer.encode(TEXT, add_special_tokens=False)
    results = []
    for op in (StockOP(tiny_tokenizer, log_stats=False), OurOP(tiny_tokenizer, log_stats=False, native_detok=native)):
        side = Side(op, async_mode=False)
        side.add(
            ReqSpec(
                request_id="r", external_id="e", prompt_ids=[1], kind=RequestOutputKind.FINAL_ONLY, logprobs=logprobs
            )
        )
        for toks, wv, fin in [
            (ids[0:2], "v1", None),
            (ids[2:3], "v1", None),
            (ids[3:5], "v2", None),
            (ids[5:6], None, None),
            (ids[6:7], "v1", FinishReason.LENGTH),
        ]:
            outs, _ = side.step([eco("r", toks, fin, logprobs=logprobs)], weight_version=wv)
        results.append(outs)
    (stock_out,), (our_out,) = results
    expected = [WeightVersionSpan("v1", 0, 3), WeightVersionSpan("v2", 3, 6), WeightVersionSpan("v1", 6, 7)]
    assert stock_out.outputs[0].weight_versions == expected
    assert norm(our_out) == norm(stock_out)
