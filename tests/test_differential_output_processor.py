"""Differential suite: stock vLLM's OutputProcessor and ours, driven side by side
with the same hypothesis-generated requests and EngineCoreOutput streams (built
twice, once per side: the processors mutate them). Every output field, the
collector contents, reqs_to_abort, abort results, counts and iteration stats
must match: no multimodal misses here, so nothing is meant to differ.

Run on two real vocabularies (the tiny model's Llama SentencePiece with byte
fallback, and Mistral's Tekken byte-level BPE), with the native detokenizer on
and forced off. Steps carry up to 5 tokens (speculative decoding), so stop
strings land mid-step; byte tokens split UTF-8 characters across tokens."""

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
    error_kw,
    new_iteration_stats,
    norm,
    norm_iteration_stats,
)
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine import FinishReason
from vllm.v1.engine.output_processor import OutputProcessor as StockOP
from vllm.v1.metrics.stats import PrefillStats

from vllm_mmretry.output_processor import OutputProcessor as OurOP

STOPS = ["fox", " the", "\n", "og.", "zz", "ab", "京 ✓", "é"]
TEXT = "The quick brown fox jumps over the lazy dog.\nA cab of zzz, the end. Ünïcode 東京 ✓ café"
SPLIT = "東✓é"  # characters also fed as single UTF-8 byte tokens
KINDS = [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY]


def _byte_level_chars() -> dict[int, str]:
    """GPT-2's byte -> printable char map (byte-level BPE token spelling)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


@pytest.fixture(scope="module", params=["llama", "tekken"])
def tokenizer_and_vocab(request: pytest.FixtureRequest) -> tuple[Any, list[int], list[int]]:
    """(vLLM tokenizer, token ids the streams draw from): the text's tokens, the
    special/added ones (BOS/EOS, Llama's <image>), and single-byte tokens."""
    if request.param == "llama":
        tok = request.getfixturevalue("tiny_tokenizer")
        byte_token = lambda b: f"<0x{b:02X}>"  # noqa: E731
    else:
        from tekken_tokenizer import ensure_tekken_tokenizer
        from vllm.tokenizers import get_tokenizer

        tok = get_tokenizer(str(ensure_tekken_tokenizer()))
        chars = _byte_level_chars()
        byte_token = lambda b: chars[b]  # noqa: E731
    ids = set(tok.encode(TEXT, add_special_tokens=False))
    ids |= {tok.convert_tokens_to_ids(byte_token(b)) for b in SPLIT.encode()}
    special = sorted(set(tok.all_special_ids))[:3] + ([32000] if request.param == "llama" else [])
    assert len(ids) > 20 and all(isinstance(i, int) for i in ids)
    # The text itself as a stream (split chars as byte tokens): stop strings match often.
    stream = tok.encode(TEXT, add_special_tokens=False) + [
        tok.convert_tokens_to_ids(byte_token(b)) for b in SPLIT.encode()
    ]
    return tok, sorted(ids) + special, stream


def _specs(data: st.DataObject, vocab: list[int]) -> list[ReqSpec]:
    specs = []
    for i in range(data.draw(st.integers(1, 4), label="num_requests")):
        specs.append(
            ReqSpec(
                request_id=f"req{i}",
                external_id=data.draw(st.sampled_from([f"ext{i}", "shared"])),
                prompt_ids=data.draw(st.lists(st.sampled_from(vocab), min_size=1, max_size=6)),
                n=data.draw(st.sampled_from([1, 1, 2, 3])),
                kind=data.draw(st.sampled_from(KINDS)),
                stop=data.draw(
                    st.one_of(st.none(), st.lists(st.sampled_from(STOPS), min_size=1, max_size=2, unique=True))
                ),
                include_stop=data.draw(st.booleans()),
                stream_interval=data.draw(st.sampled_from([None, None, 2, 3])),
                logprobs=data.draw(st.sampled_from([None, None, None, 0, 2])),
                min_tokens=data.draw(st.sampled_from([0, 0, 2, 4])),
                skip_special_tokens=data.draw(st.booleans()),
                spaces_between_special_tokens=data.draw(st.booleans()),
                stop_token_ids=data.draw(st.sampled_from([None, None, vocab[:2]])),
                detokenize=data.draw(st.sampled_from([True, True, True, False])),
            )
        )
    return specs


def _prefill(breakdown: tuple[int, int] | None) -> PrefillStats | None:
    if breakdown is None:
        return None
    prompt, cached = breakdown
    return PrefillStats(num_prompt_tokens=prompt, num_computed_tokens=prompt - cached,
                        num_cached_tokens=cached, num_local_cached_tokens=cached)


@pytest.mark.parametrize("native", [True, False], ids=["native_detok", "python_detok"])
@settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(data=st.data())
def test_same_outputs_as_stock(
    tokenizer_and_vocab: tuple[Any, list[int], list[int]], native: bool, data: st.DataObject
) -> None:
    tokenizer, vocab, stream = tokenizer_and_vocab
    cursor: dict[str, int] = {}
    async_mode = data.draw(st.booleans(), label="async_mode")
    log_stats = data.draw(st.booleans(), label="log_stats")
    interval = data.draw(st.sampled_from([1, 1, 2]), label="engine_stream_interval")
    stock = Side(StockOP(tokenizer, log_stats=log_stats, stream_interval=interval), async_mode)
    ours = Side(OurOP(tokenizer, log_stats=log_stats, stream_interval=interval, native_detok=native), async_mode)
    specs = _specs(data, vocab)

    live, logprobs_of = add_to_both(stock, ours, specs)
    # The detokenizer really is the one asked for: every fast request that
    # detokenizes runs natively (or none does).
    fast_detok = [cid for s in specs if s.detokenize and s.logprobs is None for cid in ours.children[s.request_id]]
    assert all(ours.op._core.is_native(cid) == native for cid in fast_detok)
    assert ours.op.counters()["native_detok"] == (len(fast_detok) if native else 0)
    parents = [s.request_id for s in specs if s.n > 1]
    externals = sorted({s.external_id for s in specs})

    def compare_counts() -> None:
        assert ours.op.get_num_unfinished_requests() == stock.op.get_num_unfinished_requests()
        assert ours.op.has_unfinished_requests() == stock.op.has_unfinished_requests()
        assert ours.op.get_num_queued_tokens() == stock.op.get_num_queued_tokens()
        for rid in live + parents:
            assert ours.op.has_request(rid) == stock.op.has_request(rid)

    def compare_collectors() -> None:
        a, b = stock.drain(), ours.drain()
        assert {k: norm(v) for k, v in b.items()} == {k: norm(v) for k, v in a.items()}

    for _ in range(data.draw(st.integers(1, 10), label="num_steps")):
        action = data.draw(st.sampled_from(["step"] * 5 + ["abort"]))
        if action == "abort":
            internal = data.draw(st.booleans())
            # Stock raises on a parent id together with one of its children in
            # one call (it unlinks the child twice); AsyncLLM never does that.
            if internal:
                pool = [*data.draw(st.sampled_from([live, parents])), "unknown"]
            else:
                pool = [*externals, "unknown"]
            ids = data.draw(st.lists(st.sampled_from(pool), min_size=1, max_size=3, unique=True))
            a = stock.op.abort_requests(list(ids), internal=internal)
            b = ours.op.abort_requests(list(ids), internal=internal)
            assert b == a
            live = [x for x in live if x not in a]
        else:
            chosen = [r for r in live if data.draw(st.booleans())]
            plan = []
            for rid in chosen:
                if data.draw(st.booleans()):
                    # Next tokens of the text, from a random start per request.
                    at = cursor.setdefault(rid, data.draw(st.integers(0, len(stream) - 1)))
                    k = data.draw(st.integers(0, 5))
                    toks = [stream[(at + j) % len(stream)] for j in range(k)]
                    cursor[rid] = at + k
                else:
                    toks = data.draw(st.lists(st.sampled_from(vocab), min_size=0, max_size=5))
                fin = data.draw(
                    st.sampled_from(
                        [None] * 6 + [FinishReason.LENGTH, FinishReason.STOP, FinishReason.ABORT, FinishReason.ERROR]
                    )
                )
                stop_reason = toks[-1] if (fin == FinishReason.STOP and toks and data.draw(st.booleans())) else None
                if fin is not None and not toks and fin != FinishReason.ABORT:
                    toks = [vocab[0]]
                err = data.draw(st.sampled_from([None] * 8 + ENGINE_ERRORS)) if ENGINE_ERRORS else None
                if err is not None:  # rejected by the engine (e.g. paused): nothing ran
                    toks, fin, stop_reason = [], FinishReason.ERROR, None
                # The engine's prefill breakdown: (prompt tokens, of them cached).
                prefill = data.draw(st.sampled_from([None] * 3 + [(3, 0), (5, 2), (4, 4)]))
                plan.append((rid, toks, fin, stop_reason, err, prefill))
            # Sometimes an output for a request the processor no longer tracks.
            if data.draw(st.booleans()):
                plan.append(("gone", [vocab[0]], None, None, None, None))

            def build(plan: list = plan) -> list:
                return [eco(r, t, f, s, logprobs=logprobs_of.get(r), prefill_stats=_prefill(pf),
                            **error_kw(e)) for r, t, f, s, e, pf in plan]

            its_a = new_iteration_stats() if log_stats else None
            its_b = new_iteration_stats() if log_stats else None
            # The weight version may change between steps (a weight update mid-request).
            version = data.draw(st.sampled_from(["default", "default", "v2", None]), label="weights")
            outs_a, abort_a = stock.step(build(), stats=its_a, weight_version=version)
            outs_b, abort_b = ours.step(build(), stats=its_b, weight_version=version)
            assert [norm(o) for o in outs_b] == [norm(o) for o in outs_a]
            assert abort_b == abort_a
            assert norm_iteration_stats(its_b) == norm_iteration_stats(its_a)
            done = set(abort_a) | {r for r, _, f, _, _, _ in plan if f is not None}
            live = [x for x in live if x not in done]
        if data.draw(st.booleans(), label="drain"):
            compare_collectors()
        compare_counts()
    # The rest is aborted by external id (what serving does on disconnect).
    a = stock.op.abort_requests(externals, internal=False)
    b = ours.op.abort_requests(externals, internal=False)
    assert b == a
    compare_collectors()
    compare_counts()
    assert ours.op.get_num_unfinished_requests() == stock.op.get_num_unfinished_requests()
