"""LoRA request bookkeeping (running/waiting adapters in scheduler
stats) and per-iteration statistics with LoRA requests, stock vs ours."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from output_processor_support import ReqSpec, Side, eco, new_iteration_stats, norm
from test_differential_stats import iteration_stats_form, request_stats_form
from vllm.lora.request import LoRARequest
from vllm.v1.engine import EngineCoreEvent, EngineCoreEventType, FinishReason
from vllm.v1.engine.output_processor import OutputProcessor as StockOP
from vllm.v1.metrics.stats import PrefillStats, SchedulerStats

from vllm_mmretry.output_processor import OutputProcessor as OurOP

Q, S, P = EngineCoreEventType.QUEUED, EngineCoreEventType.SCHEDULED, EngineCoreEventType.PREEMPTED


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
        ids[spec.request_id] = stock.add(spec, "prompt", lora=lora)
        assert ours.add(spec, "prompt", lora=lora) == ids[spec.request_id]
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
