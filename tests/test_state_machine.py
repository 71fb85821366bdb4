"""A hypothesis state machine driving our OutputProcessor and stock vLLM's side by
side (AsyncLLM mode: one RequestOutputCollector per request), as an engine would:
requests are added (n = 1 and n > 1, stop strings, every output kind), aborted by
internal id (child or n > 1 parent) and by external id (live, finished or unknown),
and stepped with random tokens, engine finishes, stop strings and P1 cache misses.

Compared with stock (all fields, `norm`): every published output, every
`reqs_to_abort`, every `abort_requests` answer, the tracked requests and parents.
A miss is where we differ on purpose: there only the shared part is compared (for
n = 1 the output without its `error`; for n > 1 nothing of that request in that
step; stock's siblings are aborted afterwards, as AsyncLLM does on an error) and
our own contract is checked: one terminal output carrying the retryable error, the
siblings in `reqs_to_abort`.

Invariants on both sides: each request gets at most one terminal output and
nothing after it; `reqs_to_abort` is exactly the requests that left the table in
that step without the engine having finished them (what the engine must still
stop), each once; the table holds exactly what the engine still runs. At the end
every engine request is finished and then every added request has had exactly one
terminal output (an abort's included) and both tables are empty."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from output_processor_support import ReqSpec, Side, eco, norm
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine import EngineCoreOutput, FinishReason
from vllm.v1.engine.output_processor import OutputProcessor as StockOutputProcessor

from vllm_mmretry import OutputProcessor

MISS_CODE = "multimodal_cache_miss"
WORDS = [" the", " zebra", " dog", " runs", "\n", " café", " 東京", ".", " a", " zeb", "ra"]
STOPS = ["zebra", "dog", "\n\n", "a z"]


def _shared(n: Any) -> Any:
    """norm() without the `error` field: what stock and ours share on a miss."""
    name, fields = n
    return name, tuple((k, v) for k, v in fields if k != "error")


class OutputProcessorMachine(RuleBasedStateMachine):
    tokenizer: Any = None
    token_pool: tuple[int, ...] = ()

    @initialize()
    def start(self) -> None:
        self.stock = Side(StockOutputProcessor(self.tokenizer, log_stats=False), True)
        self.ours = Side(OutputProcessor(self.tokenizer, log_stats=False), True)
        self.count = 0
        self.engine: set[str] = set()  # child ids the engine still runs
        self.parent_of: dict[str, str] = {}  # child id -> request id (collector key)
        self.children: dict[str, list[str]] = {}
        self.external: dict[str, str] = {}  # request id -> external id
        self.terminal: set[str] = set()  # request ids whose terminal output was seen
        self.external_aborted: set[str] = set()  # n>1 requests aborted by external id

    # ------------------------------------------------------------------ helpers
    def _tracked(self, side: Side) -> set[str]:
        return set(side.op.request_states)

    def _drain(self, skip: set[str] = frozenset()) -> dict[str, Any]:
        """Drain both sides' collectors; compare all but `skip`; check terminals."""
        stock, ours = self.stock.drain(), self.ours.drain()
        for rid in set(stock) | set(ours):
            if rid not in skip:
                assert (norm(ours.get(rid)) if rid in ours else None) == (
                    norm(stock.get(rid)) if rid in stock else None), rid
        for rid, out in ours.items():
            assert rid not in self.terminal, f"output for {rid} after its terminal output"
            if out.finished:
                self.terminal.add(rid)
        return ours

    def _check_aborts(self, side: Side, before: set[str], finished_by_engine: set[str],
                      reqs_to_abort: list[str]) -> None:
        """`reqs_to_abort` is exactly what left the table without the engine finishing it."""
        left = before - self._tracked(side)
        must_stop = left - finished_by_engine
        assert len(reqs_to_abort) == len(set(reqs_to_abort)), reqs_to_abort
        assert set(reqs_to_abort) == must_stop, (reqs_to_abort, must_stop)

    # ------------------------------------------------------------------ rules
    @rule(n=st.sampled_from([1, 1, 2, 3]), kind=st.sampled_from(list(RequestOutputKind)),
          stop=st.one_of(st.none(), st.lists(st.sampled_from(STOPS), min_size=1, max_size=2,
                                            unique=True)),
          include_stop=st.booleans(), shared_external=st.booleans(),
          prompt=st.lists(st.integers(3, 31999), min_size=1, max_size=4))
    def add(self, n: int, kind: RequestOutputKind, stop: list[str] | None,
            include_stop: bool, shared_external: bool, prompt: list[int]) -> None:
        self.count += 1
        rid = f"r{self.count}"
        live_ext = sorted({self.external[self.parent_of[c]] for c in self.engine})
        ext = live_ext[0] if shared_external and live_ext else f"ext{self.count}"
        spec = ReqSpec(rid, ext, prompt, n=n, kind=kind, stop=stop, include_stop=include_stop)
        ids = self.stock.add(spec)
        assert self.ours.add(spec) == ids
        self.children[rid], self.external[rid] = ids, ext
        for cid in ids:
            self.parent_of[cid] = rid
        self.engine |= set(ids)

    @precondition(lambda self: self.engine)
    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        running = sorted(self.engine)
        chosen = data.draw(st.lists(st.sampled_from(running), min_size=1, unique=True))
        ecos: list[EngineCoreOutput] = []
        missed: set[str] = set()  # request ids with a miss this step
        for cid in chosen:
            what = data.draw(st.sampled_from(["tokens"] * 6 + ["length", "eos", "miss"]))
            if what == "miss" and self.parent_of[cid] not in missed:
                missed.add(self.parent_of[cid])
                ecos.append(eco(cid, [], FinishReason.ERROR, mm_cache_miss_hashes=["h-" + cid]))
                continue
            toks = data.draw(st.lists(st.sampled_from(self.token_pool), min_size=1, max_size=3))
            finish = {"length": FinishReason.LENGTH, "eos": FinishReason.STOP}.get(what)
            ecos.append(eco(cid, toks, finish))
        finished_by_engine = {e.request_id for e in ecos if e.finish_reason is not None}
        before_stock, before_ours = self._tracked(self.stock), self._tracked(self.ours)
        # The processors consume fields of the outputs (miss hashes): one copy each.
        _, stock_abort = self.stock.step(copy.deepcopy(ecos))
        _, ours_abort = self.ours.step(ecos)
        self._check_aborts(self.stock, before_stock, finished_by_engine, stock_abort)
        multi = {r for r in missed if len(self.children[r]) > 1}
        self._check_aborts(self.ours, before_ours, finished_by_engine, ours_abort)
        if not missed:
            assert ours_abort == stock_abort
        else:
            # Ours also stops the siblings of a missed child; stock leaves them running.
            siblings = {c for r in missed for c in self.children[r] if c in self.engine
                        and c not in finished_by_engine}
            assert set(ours_abort) == siblings | set(stock_abort)
        stock_out, ours_out = self.stock.drain(), self.ours.drain()
        for rid in set(stock_out) | set(ours_out):
            mine, theirs = ours_out.get(rid), stock_out.get(rid)
            if rid in multi:
                continue  # ours answers the request now, stock when its siblings end
            if rid in missed:
                assert mine is not None and theirs is not None
                assert _shared(norm(mine)) == _shared(norm(theirs))
            else:
                assert (None if mine is None else norm(mine)) == (
                    None if theirs is None else norm(theirs)), rid
        for rid, out in ours_out.items():
            assert rid not in self.terminal, f"output for {rid} after its terminal output"
            if out.finished:
                self.terminal.add(rid)
        for rid in missed:
            out = ours_out.get(rid)
            assert out is not None and out.finished, rid
            assert out.error is not None and out.error.code == MISS_CODE and out.error.retryable
        self.engine -= finished_by_engine | set(ours_abort)
        if multi:
            # Stock's consumer (AsyncLLM) aborts the siblings on an error; then both
            # tables agree again. What stock publishes for them is not compared.
            siblings = [c for r in sorted(multi) for c in self.children[r]
                        if c in self._tracked(self.stock)]
            stock_ids = self.stock.op.abort_requests(sorted(multi), internal=True)
            assert sorted(stock_ids) == sorted(siblings)
            self.stock.drain()

    @precondition(lambda self: self.children)
    @rule(data=st.data(), parent=st.booleans())
    def abort_internal(self, data: st.DataObject, parent: bool) -> None:
        rid = data.draw(st.sampled_from(sorted(self.children)))
        ids = [rid] if parent else [data.draw(st.sampled_from(self.children[rid]))]
        self._abort(ids, internal=True)

    @rule(data=st.data(), unknown=st.booleans())
    def abort_external(self, data: st.DataObject, unknown: bool) -> None:
        known = sorted(set(self.external.values()))
        ext = "ext-none" if unknown or not known else data.draw(st.sampled_from(known))
        self.external_aborted |= {self.parent_of[c] for c in self.engine
                                  if self.external[self.parent_of[c]] == ext}
        self._abort([ext], internal=False)

    def _abort(self, ids: list[str], internal: bool) -> None:
        before_ours = self._tracked(self.ours)
        stock_ids = self.stock.op.abort_requests(list(ids), internal=internal)
        ours_ids = self.ours.op.abort_requests(list(ids), internal=internal)
        assert ours_ids == stock_ids
        # Exactly the requests the engine still runs that left the table.
        assert set(ours_ids) == before_ours - self._tracked(self.ours)
        assert set(ours_ids) <= self.engine
        self.engine -= set(ours_ids)
        self._drain()

    # ------------------------------------------------------------------ invariants
    @invariant()
    def tables_match_the_engine(self) -> None:
        if not hasattr(self, "ours"):
            return
        assert self._tracked(self.ours) == self._tracked(self.stock) == self.engine
        # A parent is tracked exactly while one of its children is. Stock keeps a
        # parent whose children were aborted by their own or the external id (a
        # leak); ours drops it (pinned by test_parent_dropped_after_external_abort).
        live_parents = {self.parent_of[c] for c in self.engine
                        if len(self.children[self.parent_of[c]]) > 1}
        ours_parents = set(self.ours.op.parent_requests)
        assert ours_parents == live_parents
        assert ours_parents <= set(self.stock.op.parent_requests)
        assert self.ours.op.get_num_unfinished_requests() == len(self.engine)

    def teardown(self) -> None:
        if not hasattr(self, "ours"):
            return
        # The engine finishes everything still running.
        if self.engine:
            ecos = [eco(cid, [self.token_pool[0]], FinishReason.LENGTH) for cid in sorted(self.engine)]
            _, stock_abort = self.stock.step(copy.deepcopy(ecos))
            _, ours_abort = self.ours.step(ecos)
            assert ours_abort == stock_abort == []
            self.engine.clear()
            self._drain()
        assert self.terminal == set(self.children), set(self.children) - self.terminal
        assert not self._tracked(self.ours) and not self._tracked(self.stock)
        assert not self.ours.op.parent_requests
        assert not self.ours.op.has_unfinished_requests()


@pytest.mark.parametrize("seedless", [None])
def test_output_processor_state_machine(tiny_tokenizer: Any, seedless: None) -> None:
    pool = sorted({t for w in WORDS for t in tiny_tokenizer.encode(w, add_special_tokens=False)})
    OutputProcessorMachine.tokenizer = tiny_tokenizer
    OutputProcessorMachine.token_pool = tuple(pool)
    test_case = OutputProcessorMachine.TestCase
    test_case.settings = settings(max_examples=60, stateful_step_count=30, deadline=None,
                                  suppress_health_check=[HealthCheck.too_slow])
    test_case().runTest()


def test_sibling_the_engine_finished_in_the_miss_step_is_not_aborted(tiny_tokenizer: Any) -> None:
    """reqs_to_abort is what the engine must still stop: a sibling whose finished
    output follows the miss in the same step is already stopped."""
    ours = Side(OutputProcessor(tiny_tokenizer, log_stats=False), True)
    ids = ours.add(ReqSpec("r", "e", [1, 2], n=3))
    miss = eco(ids[1], [], FinishReason.ERROR, mm_cache_miss_hashes=["h"])
    _, reqs_to_abort = ours.step([miss, eco(ids[0], [450], FinishReason.LENGTH)])
    assert reqs_to_abort == [ids[2]]
    assert not ours.op.has_unfinished_requests() and not ours.op.parent_requests


def test_sibling_still_running_after_the_miss_step_is_aborted(tiny_tokenizer: Any) -> None:
    ours = Side(OutputProcessor(tiny_tokenizer, log_stats=False), True)
    ids = ours.add(ReqSpec("r", "e", [1, 2], n=3))
    miss = eco(ids[1], [], FinishReason.ERROR, mm_cache_miss_hashes=["h"])
    _, reqs_to_abort = ours.step([miss, eco(ids[0], [450], None)])
    assert sorted(reqs_to_abort) == sorted([ids[0], ids[2]])


def test_miss_without_tokens_has_stocks_weight_versions(tiny_tokenizer: Any) -> None:
    weight_versions = []
    for side in (Side(OutputProcessor(tiny_tokenizer, log_stats=False), True),
                 Side(StockOutputProcessor(tiny_tokenizer, log_stats=False), True)):
        side.add(ReqSpec("s", "f", [1, 2]))
        side.step([eco("s", [], FinishReason.ERROR, mm_cache_miss_hashes=["h"])])
        weight_versions.append(side.drain()["s"].outputs[0].weight_versions)
    assert weight_versions[0] == weight_versions[1]


def test_parent_dropped_after_external_abort(tiny_tokenizer: Any) -> None:
    ours = Side(OutputProcessor(tiny_tokenizer, log_stats=False), True)
    ours.add(ReqSpec("r", "e", [1, 2], n=2))
    assert sorted(ours.op.abort_requests(["e"], internal=False)) == ["0_r", "1_r"]
    assert not ours.op.has_unfinished_requests()
    assert not ours.op.parent_requests
