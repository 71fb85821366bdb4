"""The drop-in surface: bad input gives clear Python exceptions, fallback counters,
RequestOutput.error compatibility, and install() wiring AsyncLLM/LLMEngine."""

from __future__ import annotations

from typing import Any

import pytest
from output_processor_support import ReqSpec, Side, eco, engine_request, norm
from vllm.outputs import CompletionOutput, RequestError, RequestOutput
from vllm.v1.engine import EngineCoreOutput, FinishReason

from vllm_mmretry import _core, _patching, plugin
from vllm_mmretry import output_processor as opm
from vllm_mmretry.output_processor import OutputProcessor
from vllm_mmretry.vllm_adapter import adapter, v0_32


@pytest.fixture
def op(tiny_tokenizer: Any) -> OutputProcessor:
    return OutputProcessor(tiny_tokenizer, log_stats=False)


def test_bad_input_is_a_python_exception(op: OutputProcessor) -> None:
    with pytest.raises(TypeError, match="EngineCoreRequest"):
        op.add_request("not a request", None)  # type: ignore[arg-type]
    op.add_request(engine_request(ReqSpec("r", "r", [1])), None)
    with pytest.raises(ValueError, match="already tracked"):
        op.add_request(engine_request(ReqSpec("r", "r", [1])), None)
    with pytest.raises(TypeError):
        op.abort_requests("r", internal=True)  # a str is not a list of ids
    with pytest.raises(TypeError):
        op.abort_requests([1, 2], internal=True)  # type: ignore[list-item]
    with pytest.raises(TypeError):
        op.process_outputs(42)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="request_id"):
        op.process_outputs([EngineCoreOutput(request_id=7, new_token_ids=[1])])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="mm_cache_miss_hashes"):
        op.process_outputs(
            [
                EngineCoreOutput(
                    request_id="r", new_token_ids=[], finish_reason=FinishReason.ERROR, mm_cache_miss_hashes=[3]
                )
            ]
        )  # type: ignore[list-item]
    # Unknown ids are ignored, as in stock vLLM.
    assert op.abort_requests(["nope"], internal=False) == []
    assert op.process_outputs([EngineCoreOutput(request_id="nope", new_token_ids=[1])]).request_outputs == []
    assert op.has_request("r")


def test_core_rejects_bad_construction_and_ids() -> None:
    import dataclasses

    vllm = adapter()
    lora_states = vllm.new_lora_states(False)
    stock = vllm.new_stock_side(None, False, 1, False, lora_states)
    good = vllm.core_spec(lora_states, vllm.self_check(None, None), stock)
    _core.OutputCore(good)
    with pytest.raises(AttributeError, match="engine_core_output"):
        _core.OutputCore(object())  # not a CoreSpec: names the missing field
    with pytest.raises(TypeError):
        _core.OutputCore(dataclasses.replace(good, request_output=42))
    with pytest.raises(TypeError, match="callable"):
        _core.OutputCore(dataclasses.replace(good, helpers=dataclasses.replace(good.helpers, stock_abort=3)))
    with pytest.raises(ValueError, match="finish codes"):
        _core.OutputCore(dataclasses.replace(good, finish_error=99))
    core = OutputProcessor(None, log_stats=False)._core
    for call in (lambda: core.state("x"), lambda: core.is_fast("x"), lambda: core.finish_request("x")):
        with pytest.raises(KeyError):
            call()


def test_fast_reads_and_fallback_counters(op: OutputProcessor) -> None:
    assert op._core.fast_field_reads  # EngineCoreOutput fields read by offset
    side = Side(op, True)
    side.add(ReqSpec("plain", "plain", [1]))
    side.add(ReqSpec("lp", "lp", [1], logprobs=1))
    assert op._core.is_fast("plain") and not op._core.is_fast("lp")
    side.step([eco("plain", [272]), eco("lp", [272], logprobs=1)])
    c = op.counters()
    assert c["fast_steps"] == 1 and c["fallback_steps"] == 1
    assert c["fallbacks"] == {"logprobs": 1}
    assert set(op.request_states) == {"plain", "lp"}


def test_request_output_error_field() -> None:
    opm.ensure_request_output_error()
    c = CompletionOutput(index=0, text="", token_ids=[], cumulative_logprob=None, logprobs=None)
    o = RequestOutput(
        request_id="x", prompt=None, prompt_token_ids=[1], prompt_logprobs=None, outputs=[c], finished=False
    )
    assert o.error is None
    err = RequestError(code="multimodal_cache_miss", message="m", retryable=True)
    o2 = RequestOutput.__new__(RequestOutput)
    v0_32._init_with_error(RequestOutput.__init__)(
        o2,
        request_id="x",
        prompt=None,
        prompt_token_ids=[1],
        prompt_logprobs=None,
        outputs=[
            CompletionOutput(
                index=0, text="a", token_ids=[5], cumulative_logprob=None, logprobs=None, finish_reason="error"
            )
        ],
        finished=True,
        error=err,
    )
    v0_32._add_keeping_error(RequestOutput.add)(o, o2, aggregate=True)
    assert o.error is err and o.finished and o.outputs[0].text == "a"


def test_install_patches_both_engines() -> None:
    from vllm.v1.engine import async_llm, llm_engine

    # Whatever ran before in this process (vLLM loads the plugin wherever it builds
    # an engine), start from stock vLLM and leave the plugin as it was found.
    registered = bool(plugin.active_patches())
    plugin.uninstall()
    labels = opm.install()
    try:
        assert async_llm.OutputProcessor is OutputProcessor
        assert llm_engine.OutputProcessor is OutputProcessor
        assert any(label.endswith("AsyncLLM.__init__") for label in labels)
        assert any(label.endswith("LLMEngine.__init__") for label in labels)
        assert any(label.endswith("RequestOutput.add") for label in labels)
        with pytest.raises(_patching.PatchError):
            opm.install()
    finally:
        _patching.restore_all()
    assert async_llm.OutputProcessor is v0_32.StockOutputProcessor
    if registered:
        plugin.register()


@pytest.mark.parametrize("ends_by", ["finish", "abort"])
def test_admission_count_follows_the_unfinished_requests(tiny_tokenizer: Any, ends_by: str) -> None:
    """vLLM's shared admission counter (SharedAdmissionStats, one slot per API server)
    holds the processor's unfinished requests after every add, step and abort."""
    from vllm.v1.engine.admission_control import SharedAdmissionStats

    slots = [0] * SharedAdmissionStats.num_counters(1)
    admission = SharedAdmissionStats({"mp_admission_counters": slots})
    op = OutputProcessor(tiny_tokenizer, log_stats=False, admission_stats=admission)
    side = Side(op, True)
    side.add(ReqSpec("a", "a", [1]))
    side.add(ReqSpec("b", "b", [1]))
    assert admission.get_num_requests() == 2
    if ends_by == "finish":
        op.process_outputs([eco("a", [272], finish=FinishReason.LENGTH)])
    else:
        op.abort_requests(["a"], internal=True)
    assert admission.get_num_requests() == 1 == op.get_num_unfinished_requests()


@pytest.mark.parametrize("which", ["request_id", "external_id", "parent_id"])
def test_a_request_id_that_is_not_utf8_is_refused_as_stocks_engine_send_refuses_it(
    tiny_tokenizer: Any, which: str
) -> None:
    """The table holds UTF-8 ids. A lone surrogate in an id is refused at `add_request` with
    the UnicodeEncodeError stock's caller gets from vLLM's msgpack send to its engine core,
    and nothing is left behind (stock keeps the request it could not send). An output or an
    abort naming such an id is then an unknown id's: ignored, as stock ignores one."""
    from vllm.v1.engine.output_processor import OutputProcessor as StockOP
    from vllm.v1.serial_utils import MsgpackEncoder

    bad = "r\ud800"
    spec = {
        "request_id": ReqSpec(bad, "r", [1]),
        "external_id": ReqSpec("r", bad, [1]),
        "parent_id": ReqSpec(bad, bad, [1], n=2),
    }[which]
    with pytest.raises(UnicodeEncodeError):
        MsgpackEncoder().encode(engine_request(spec))
    stock = Side(StockOP(tiny_tokenizer, log_stats=True), True)
    ours = Side(OutputProcessor(tiny_tokenizer, log_stats=True), True)
    with pytest.raises(UnicodeEncodeError):
        ours.add(spec)
    assert ours.op.get_num_unfinished_requests() == 0 and not ours.op.has_request(bad)
    for side in (stock, ours):
        side.add(ReqSpec("a", "a", [1]))
    step = [eco(bad, [5]), eco("a", [5, 6]), eco(bad, [7], FinishReason.LENGTH)]
    seen = []
    for side in (stock, ours):
        outs, aborts = side.step(step)
        seen.append(([norm(o) for o in outs], aborts, {k: norm(v) for k, v in side.drain().items()},
                     side.op.abort_requests([bad, "0_" + bad], internal=False)))
    assert seen[1] == seen[0] and seen[0][2]  # "a"'s output, published
    assert ours.op.has_request("a") and not ours.op.has_request(bad)
