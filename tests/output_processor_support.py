"""Helpers shared by the output-processor tests: build real vLLM requests and
engine outputs, register them the way AsyncLLM / LLMEngine do, and normalise
outputs for comparison."""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from vllm.outputs import RequestOutput
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.v1.engine import EngineCoreOutput, EngineCoreRequest, FinishReason
from vllm.v1.engine.output_processor import RequestOutputCollector
from vllm.v1.engine.parallel_sampling import ParentRequest
from vllm.v1.outputs import LogprobsLists

from vllm_mmretry.vllm_adapter import adapter


@dataclass
class ReqSpec:
    request_id: str
    external_id: str
    prompt_ids: list[int]
    n: int = 1
    kind: RequestOutputKind = RequestOutputKind.DELTA
    stop: list[str] | None = None
    include_stop: bool = False
    stream_interval: int | None = None
    logprobs: int | None = None
    min_tokens: int = 0
    skip_special_tokens: bool = True
    detokenize: bool = True
    spaces_between_special_tokens: bool = True
    stop_token_ids: list[int] | None = None

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(
            n=self.n, max_tokens=1000, output_kind=self.kind, stop=self.stop if self.detokenize else None,
            include_stop_str_in_output=self.include_stop, stream_interval=self.stream_interval,
            logprobs=self.logprobs, min_tokens=self.min_tokens,
            skip_special_tokens=self.skip_special_tokens, detokenize=self.detokenize,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            stop_token_ids=self.stop_token_ids,
        )


def engine_request(spec: ReqSpec, arrival: float = 1000.0, lora: Any = None) -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id=spec.request_id, prompt_token_ids=list(spec.prompt_ids), mm_features=None,
        sampling_params=spec.sampling_params(), pooling_params=None, arrival_time=arrival,
        lora_request=lora, cache_salt=None, data_parallel_rank=None,
        external_req_id=spec.external_id,
    )


@dataclass
class Side:
    """One output processor plus its collectors (AsyncLLM mode) or returned
    lists (LLMEngine mode)."""

    op: Any
    async_mode: bool
    collectors: dict[str, RequestOutputCollector] = field(default_factory=dict)
    children: dict[str, list[str]] = field(default_factory=dict)
    # Ours only: a failed start-up self-check hands the native parts to vLLM's code,
    # whose outputs then equal stock's and would hide a native bug from a differential
    # test. Every step checks it passed, unless a test makes it fail on purpose.
    self_check_may_fail: bool = False

    def add(self, spec: ReqSpec, prompt: str | None = "prompt text", arrival: float = 1000.0,
            lora: Any = None) -> list[str]:
        """Register like AsyncLLM.add_request / LLMEngine.add_request; returns
        the internal ids the engine core would run."""
        req = engine_request(spec, arrival, lora)
        q = RequestOutputCollector(spec.kind, spec.request_id) if self.async_mode else None
        if q is not None:
            self.collectors[spec.request_id] = q
        if spec.n == 1:
            self.op.add_request(req, prompt, None, 0, q)
            self.children[spec.request_id] = [spec.request_id]
            return [spec.request_id]
        parent = ParentRequest(req)
        ids = []
        for idx in range(spec.n):
            cid, csp = parent.get_child_info(idx)
            child = req if idx == spec.n - 1 else copy.copy(req)
            child.request_id = cid
            child.sampling_params = csp
            self.op.add_request(child, prompt, parent, idx, q)
            ids.append(cid)
        self.children[spec.request_id] = ids
        return ids

    def step(self, ecos: list[EngineCoreOutput], ts: float = 2000.0, stats: Any = None,
             weight_version: str | None = "default") -> tuple[list, list[str]]:
        res = self.op.process_outputs(ecos, ts, stats, weight_version=weight_version)
        if not self.self_check_may_fail and hasattr(self.op, "counters"):
            assert self.op.counters()["self_check_failed"] == {}
        return res.request_outputs, list(res.reqs_to_abort)

    def drain(self) -> dict[str, Any]:
        out = {}
        for rid, q in self.collectors.items():
            try:
                o = q.get_nowait()
            except Exception as e:  # noqa: BLE001 - what generate() would raise
                o = e
            if o is not None:
                out[rid] = o
        return out


def add_to_both(stock: Side, ours: Side, specs: list[ReqSpec]) -> tuple[list[str], dict[str, int | None]]:
    """Add every request to both sides (same child ids); returns the live child ids
    and each child's logprobs setting."""
    live: list[str] = []
    logprobs_of: dict[str, int | None] = {}
    for spec in specs:
        ids = stock.add(spec)
        assert ours.add(spec) == ids
        live += ids
        logprobs_of.update({cid: spec.logprobs for cid in ids})
    return live, logprobs_of


def _engine_errors() -> list[Any]:
    """The errors the running vLLM's engine puts on `EngineCoreOutput.error`
    (none where the field does not exist, e.g. 0.32)."""
    if "error" not in adapter().ECO_STRUCT_FIELDS:
        return []
    from vllm.outputs import RequestError

    return [RequestError(code="engine_paused", message="Engine is paused.", retryable=True),
            RequestError(code="validation_error", message="bad request", retryable=False)]


ENGINE_ERRORS = _engine_errors()


def error_kw(err: Any) -> dict[str, Any]:
    """`EngineCoreOutput` keyword for an engine error (nothing when None)."""
    return {} if err is None else {"error": err}


def streaming_input_collector(kind: RequestOutputKind, request_id: str) -> RequestOutputCollector:
    """The collector the running vLLM's AsyncLLM gives a streaming-input request."""
    return adapter().streaming_input_collector()(kind, request_id)


def eco(rid: str, tokens: list[int], finish: FinishReason | None = None, stop_reason: Any = None,
        logprobs: int | None = None, **kw: Any) -> EngineCoreOutput:
    lp = None
    if logprobs is not None and tokens:
        k = logprobs + 1
        ids = np.array([[t] + [(t + j) % 32000 for j in range(1, k)] for t in tokens], dtype=np.int64)
        vals = np.array([[-0.5 * (j + 1) - 0.01 * (t % 7) for j in range(k)] for t in tokens], dtype=np.float32)
        ranks = np.array([1 + t % 3 for t in tokens], dtype=np.int64)
        lp = LogprobsLists(ids, vals, ranks, None)
    return EngineCoreOutput(request_id=rid, new_token_ids=list(tokens), finish_reason=finish,
                            stop_reason=stop_reason, new_logprobs=lp, **kw)


def norm_logprobs(lps: Any) -> Any:
    if lps is None:
        return None
    return [
        {tid: (round(float(lp.logprob), 5), lp.rank, lp.decoded_token) for tid, lp in pos.items()}
        for pos in lps
    ]


def _norm_field(key: str, v: Any) -> Any:
    """A field value in comparable form (arrays, logprobs, stats, errors)."""
    if v is None:
        return None
    if key == "logprobs":
        return norm_logprobs(v)
    if key == "metrics":
        return _norm_stats(v)
    if key == "error":
        return (type(v).__name__, v.code, v.retryable)
    if key == "outputs":
        # None: a FINAL_ONLY parent's slot of a child that finished without output
        # (e.g. rejected by the engine on 0.33), as vLLM's ParentRequest leaves it.
        return [None if c is None else _norm_vars(c) for c in v]
    if key in ("prompt_token_ids", "token_ids"):
        return list(v)
    if isinstance(v, np.ndarray) or hasattr(v, "tolist"):
        return np.asarray(v).tolist()
    return v


def _norm_vars(o: Any) -> Any:
    """Every instance attribute (`vars()`), so a field added by vLLM or by
    another plugin is compared too, and in vLLM's order (what `vars()`, `repr`
    of a dict copy and serialisers that walk `__dict__` see)."""
    return (type(o).__name__, tuple((k, _norm_field(k, v)) for k, v in vars(o).items()))


def norm(o: Any) -> Any:
    """Every RequestOutput/CompletionOutput field (full `vars()`), in comparable form."""
    if not isinstance(o, RequestOutput):
        return ("other", type(o).__name__, repr(o))
    return _norm_vars(o)


def _norm_stats(s: Any) -> Any:
    return tuple(sorted((k, v) for k, v in vars(s).items()))


def norm_iteration_stats(st: Any) -> Any:
    if st is None:
        return None
    d = dict(vars(st))
    d.pop("iteration_timestamp", None)
    d["prompt_token_stats"] = vars(d["prompt_token_stats"])
    return repr(sorted(d.items()))


def new_iteration_stats() -> Any:
    from vllm.v1.metrics.stats import IterationStats

    st = IterationStats()
    st.iteration_timestamp = 3000.0
    return st


def now() -> float:
    return time.monotonic()
