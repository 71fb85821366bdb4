"""LoRA request bookkeeping (running/waiting adapters in scheduler
stats) and per-iteration statistics with LoRA requests, stock vs ours."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from output_processor_support import ReqSpec, Side, eco, new_iteration_stats, norm
from test_differential_stats import iteration_stats_form, request_stats_form
from vllm.lora.request import LoRARequest
from vllm.v1.engine import EngineCoreEvent, EngineCoreEventType, EngineCoreRequest, FinishReason
from vllm.v1.engine.output_processor import OutputProcessor as StockOP
from vllm.v1.engine.parallel_sampling import ParentRequest
from vllm.v1.metrics.stats import PrefillStats, SchedulerStats

from vllm_mmretry.output_processor import OutputProcessor as OurOP

Q, S, P = EngineCoreEventType.QUEUED, EngineCoreEventType.SCHEDULED, EngineCoreEventType.PREEMPTED


def _add(side: Side, spec: ReqSpec, lora: Any) -> list[str]:
    req = EngineCoreRequest(
        request_id=spec.request_id, prompt_token_ids=list(spec.prompt_ids), mm_features=None,
        sampling_params=spec.sampling_params(), pooling_params=None, arrival_time=1000.0,
        lora_request=lora, cache_salt=None, data_parallel_rank=None, external_req_id=spec.external_id)
    from vllm.v1.engine.output_processor import RequestOutputCollector
    q = RequestOutputCollector(spec.kind, spec.request_id)
    side.collectors[spec.request_id] = q
    if spec.n == 1:
        side.op.add_request(req, "prompt", None, 0, q)
        return [spec.request_id]
    parent = ParentRequest(req)
    ids = []
    for idx in range(spec.n):
        cid, csp = parent.get_child_info(idx)
        child = req if idx == spec.n - 1 else copy.copy(req)
        child.request_id = cid
        child.sampling_params = csp
        side.op.add_request(child, "prompt", parent, idx, q)
        ids.append(cid)
    return ids


def _sched(side: Side) -> Any:
    s = SchedulerStats()
    side.op.update_scheduler_stats(s)
    return (sorted(s.running_lora_adapters.items()), sorted(s.waiting_lora_adapters.items()))


@pytest.mark.parametrize("logprobs", [None, 1])
def test_lora_bookkeeping_as_stock(tiny_tokenizer: Any, logprobs: Any) -> None:
    toks = tiny_tokenizer.encode("The quick brown fox jumps over the lazy dog.", add_special_tokens=False)
    la, lb = LoRARequest("a", 1, "/tmp/a"), LoRARequest("b", 2, "/tmp/b")
    specs = [(ReqSpec("r0", "e0", toks[:3], logprobs=logprobs), la),
             (ReqSpec("r1", "e1", toks[:3], stop=["fox"], logprobs=logprobs), la),
             (ReqSpec("r2", "e2", toks[:3], n=2, logprobs=logprobs), lb),
             (ReqSpec("r3", "e3", toks[:3], logprobs=logprobs), lb)]
    stock, ours = Side(StockOP(tiny_tokenizer, log_stats=True), True), Side(OurOP(tiny_tokenizer, log_stats=True), True)
    ids = {}
    for spec, lora in specs:
        ids[spec.request_id] = _add(stock, spec, lora)
        assert _add(ours, spec, lora) == ids[spec.request_id]
    kids = ids["r2"]
    ev = lambda *ts: [EngineCoreEvent(type=t, timestamp=5000.0 + i) for i, t in enumerate(ts)]  # noqa: E731
    steps = [
        [eco("r0", [], events=ev(Q)), eco("r1", [], events=ev(Q)), eco(kids[0], [], events=ev(Q)),
         eco(kids[1], [], events=ev(Q)), eco("r3", [], events=ev(Q))],
        [eco("r0", [toks[0]], events=ev(S), prefill_stats=PrefillStats(3, 3, 0, 0, 0, 0)),
         eco("r1", [toks[0]], events=ev(S)), eco(kids[0], [toks[0]], events=ev(S)),
         eco(kids[1], [toks[0]], events=ev(S)), eco("r3", [toks[0]], events=ev(S))],
        [eco("r0", [toks[1]], events=ev(P)), eco("r1", [toks[1]]), eco(kids[0], [toks[1]])],
        [eco("r0", [toks[2]], events=ev(S)), eco("r1", [toks[2]]), eco(kids[0], [toks[2]], finish=FinishReason.LENGTH),
         eco(kids[1], [toks[1]])],
        [eco("r1", [toks[3]]), eco("r1", [toks[4]]), eco(kids[1], [toks[2]], finish=FinishReason.STOP)],
        [eco("r1", [toks[4]]), eco("r0", [toks[3]], finish=FinishReason.ABORT)],
    ]
    ts = 5000.0
    for i, step in enumerate(steps):
        ts += 0.5
        forms = []
        for side in (stock, ours):
            its = new_iteration_stats()
            its.iteration_timestamp = 1000.0 + i
            outs, aborts = side.step(copy.deepcopy(step), ts=ts, stats=its)
            forms.append((iteration_stats_form(its), [norm(o) for o in outs], aborts, _sched(side),
                          request_stats_form(side.op)))
        assert forms[1] == forms[0], f"step {i}"
    for side in (stock, ours):
        side.op.abort_requests(["e3"], internal=False)
    assert _sched(ours) == _sched(stock)
