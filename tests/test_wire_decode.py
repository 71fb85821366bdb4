"""The native engine-output reader (`_core.OutputsReader`, behind
`receive.NativeOutputsDecoder`) against vLLM's `MsgpackDecoder(EngineCoreOutputs)`.

Every message vLLM's `MsgpackEncoder` writes must decode to the same object, compared
in full (`repr`, so types count, and `==`); every other byte string must give the
same result or the same exception. Messages come from hypothesis (all per-request
fields, ext-encoded arrays, utility replies and failures, scheduler stats, misses)
and from a real engine (`test_recorded_engine_messages_decode_as_vllm_decodes`)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import msgspec
import numpy as np
import pytest
from engine_outputs_support import decode_both, reader
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from vllm.v1.engine import (
    EngineCoreEvent,
    EngineCoreEventType,
    EngineCoreOutput,
    EngineCoreOutputs,
    FinishReason,
    UtilityOutput,
)
from vllm.v1.metrics.stats import PrefixCacheStats, SchedulerStats
from vllm.v1.serial_utils import MsgpackEncoder, UtilityResult

from vllm_mmretry import _core
from vllm_mmretry.vllm_adapter import adapter

I64 = st.integers(-(2**63), 2**64 - 1)

output_st = st.builds(
    EngineCoreOutput,
    request_id=st.text(min_size=0, max_size=40),
    new_token_ids=st.lists(st.integers(0, 2**31 - 1) | I64, max_size=6),
    finish_reason=st.none() | st.sampled_from(list(FinishReason)),
    stop_reason=st.none() | I64 | st.text(max_size=5),
    num_nans_in_logits=st.integers(0, 2**40),
    mm_cache_miss_hashes=st.none() | st.lists(st.text("0123456789abcdef", min_size=1, max_size=8),
                                              max_size=2),
    kv_transfer_params=st.none() | st.dictionaries(st.text(max_size=3), I64, max_size=2),
    events=st.none() | st.lists(st.builds(EngineCoreEvent, type=st.sampled_from(list(EngineCoreEventType)),
                                          timestamp=st.floats(0, 1e6)), max_size=2),
    routed_experts=st.none() | st.lists(st.integers(0, 7), min_size=1, max_size=300).map(
        lambda v: np.array(v, dtype=np.int32)),
)
# Mostly the common shape, so the native path is taken often.
plain_output_st = st.builds(
    EngineCoreOutput,
    request_id=st.text(max_size=40),
    new_token_ids=st.lists(st.integers(0, 2**31 - 1), max_size=4),
    finish_reason=st.none() | st.sampled_from(list(FinishReason)),
    stop_reason=st.none() | st.integers(0, 9) | st.text(max_size=5),
)
stats_st = st.none() | st.builds(
    SchedulerStats, num_running_reqs=st.integers(0, 9), num_waiting_reqs=st.integers(0, 9),
    kv_cache_usage=st.floats(0, 1), prefix_cache_stats=st.builds(PrefixCacheStats, queries=st.integers(0, 99)))
utility_st = st.none() | st.builds(
    UtilityOutput, call_id=st.integers(0, 2**31),
    failure_message=st.none() | st.text(max_size=8),
    result=st.none() | st.builds(UtilityResult, st.integers(-5, 5) | st.text(max_size=4) | st.none()))
outputs_st = st.builds(
    EngineCoreOutputs,
    engine_index=st.integers(0, 3),
    outputs=st.lists(plain_output_st | output_st, max_size=6),
    scheduler_stats=stats_st,
    timestamp=st.floats(1e-3, 1e9, allow_nan=False),
    utility_output=utility_st,
    finished_requests=st.none() | st.sets(st.text(max_size=3), max_size=2),
    wave_complete=st.none() | st.integers(0, 5),
    start_wave=st.none() | st.integers(0, 5),
)


def test_the_adapter_gives_the_layout_of_this_vllm() -> None:
    kinds = reader().output_kinds
    fields = EngineCoreOutput.__struct_fields__
    assert len(kinds) == len(fields)
    read = {f: k for f, k in zip(fields, kinds, strict=True) if k != "nil"}
    assert read == {"request_id": "str", "new_token_ids": "int_list", "finish_reason": "opt_enum",
                    "stop_reason": "opt_int_or_str", "num_nans_in_logits": "int"}
    wire = adapter().outputs_wire()
    assert not isinstance(wire, str) and kinds == wire.output_kinds


def test_the_common_message_is_read_natively() -> None:
    msg = EngineCoreOutputs(engine_index=1, outputs=[
        EngineCoreOutput(request_id="a", new_token_ids=[1, 2]),
        EngineCoreOutput(request_id="b", new_token_ids=[], finish_reason=FinishReason.STOP, stop_reason="\n"),
    ], scheduler_stats=SchedulerStats(num_running_reqs=2))
    frames = MsgpackEncoder().encode(msg)
    vllm, native, ours = decode_both(frames)
    assert (ours.native, ours.stepped_aside) == (1, 0)
    assert native[:2] == vllm[:2]
    assert type(native[2].outputs[1].finish_reason) is FinishReason


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(msg=outputs_st)
def test_generated_messages_decode_as_vllm_decodes(msg: EngineCoreOutputs) -> None:
    frames = MsgpackEncoder().encode(msg)
    vllm, native, _ = decode_both(frames)
    assert native[:2] == vllm[:2]


@settings(max_examples=300, deadline=None)
@given(msg=outputs_st, data=st.data())
def test_damaged_messages_give_vllms_answer(msg: EngineCoreOutputs, data: st.DataObject) -> None:
    """Bytes cut, changed or appended: the same object or the same error as vLLM's."""
    frame = bytearray(MsgpackEncoder().encode(msg)[0])
    how = data.draw(st.sampled_from(["cut", "flip", "append"]))
    if how == "cut":
        frame = frame[: data.draw(st.integers(0, len(frame)))]
    elif how == "flip":
        i = data.draw(st.integers(0, len(frame) - 1))
        frame[i] = data.draw(st.integers(0, 255))
    else:
        frame += data.draw(st.binary(min_size=1, max_size=4))
    vllm, native, _ = decode_both([bytes(frame)])
    assert native[:2] == vllm[:2]


@settings(max_examples=200, deadline=None)
@given(raw=st.binary(max_size=64))
def test_arbitrary_bytes_give_vllms_answer(raw: bytes) -> None:
    vllm, native, _ = decode_both([raw])
    assert native[:2] == vllm[:2]


def test_zmq_frames_and_memoryviews_are_read_like_bytes() -> None:
    import zmq

    msg = EngineCoreOutputs(outputs=[EngineCoreOutput(request_id="r", new_token_ids=[5])])
    raw = bytes(MsgpackEncoder().encode(msg)[0])
    for frame in (zmq.Frame(raw), memoryview(raw), bytearray(raw)):
        vllm, native, ours = decode_both([frame])
        assert native[:2] == vllm[:2] and ours.native == 1


def test_a_reader_refuses_a_schema_that_does_not_add_up() -> None:
    from dataclasses import replace

    wire = adapter().outputs_wire()
    assert not isinstance(wire, str)
    for bad in (replace(wire, output_kinds=wire.output_kinds[:-1]),
                replace(wire, field_decoders=wire.field_decoders[:-1]),
                replace(wire, output_kinds=["str", "tensor", *wire.output_kinds[2:]])):
        with pytest.raises(ValueError):
            _core.OutputsReader(bad)


# A real engine (the tiny model, statistics on) in a subprocess, its output frames
# recorded as its async client receives them: streams with stop strings, n = 2,
# length and stop finishes, a utility call and a utility failure.
RECORD = textwrap.dedent(
    """
    import asyncio, base64, json, sys
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine import EngineCoreOutputs, core_client
    from vllm.v1.engine.async_llm import AsyncLLM

    class Recording:
        def __init__(self, inner):
            self.inner, self.frames = inner, []
        def decode(self, frames):
            self.frames.append([base64.b64encode(bytes(f)).decode() for f in frames])
            return self.inner.decode(frames)

    # The client builds its decoder, and its output task takes it, at construction.
    recordings = []
    vllm_decoder = core_client.MsgpackDecoder
    def recording_decoder(*args, **kwargs):
        d = vllm_decoder(*args, **kwargs)
        if args[:1] == (EngineCoreOutputs,):
            d = Recording(d)
            recordings.append(d)
        return d
    core_client.MsgpackDecoder = recording_decoder

    async def main():
        args = AsyncEngineArgs(model=sys.argv[1], dtype="float32", max_model_len=512,
                               enforce_eager=True, kv_cache_memory_bytes=64 * 1024 * 1024, seed=0)
        engine = AsyncLLM.from_engine_args(args)
        client = engine.engine_core
        (rec,) = recordings
        params = [SamplingParams(temperature=0, max_tokens=12),
                  SamplingParams(temperature=0, max_tokens=16, stop=[" the", "\\\\n"]),
                  SamplingParams(temperature=0.8, seed=7, n=2, max_tokens=6)]
        async def run(i, p):
            async for _ in engine.generate("Hello, my name is", p, request_id=f"req-{i}"):
                pass
        await asyncio.gather(*(run(i, p) for i, p in enumerate(params)))
        await engine.reset_prefix_cache()
        try:
            await client.call_utility_async("no_such_utility")
        except Exception as e:
            print("UTILITY_FAILED", type(e).__name__)
        engine.shutdown()
        print("RECORDED " + json.dumps(rec.frames))

    asyncio.run(main())
    """
)


@pytest.mark.slow  # one engine start-up
def test_recorded_engine_messages_decode_as_vllm_decodes(tiny_model_path: str, tmp_path: pathlib.Path) -> None:
    import base64

    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_MMRETRY_NATIVE_DECODE="0")
    out = tmp_path / "record.log"
    with open(out, "wb") as f:
        proc = subprocess.run([sys.executable, "-c", RECORD, tiny_model_path], env=env,
                              stdout=f, stderr=subprocess.STDOUT, timeout=600)
    text = out.read_text(errors="replace")
    lines = [ln for ln in text.splitlines() if ln.startswith("RECORDED ")]
    assert proc.returncode == 0 and lines and "UTILITY_FAILED" in text, text[-4000:]
    recorded = [[base64.b64decode(f) for f in m] for m in json.loads(lines[-1][len("RECORDED "):])]
    kinds = {"stats": 0, "finished": 0, "utility": 0, "failure": 0}
    native = 0
    for frames in recorded:
        vllm, ours, dec = decode_both(frames)
        assert ours[:2] == vllm[:2]
        native += dec.native
        m = vllm[2]
        kinds["stats"] += m.scheduler_stats is not None
        kinds["finished"] += any(o.finish_reason is not None for o in m.outputs)
        kinds["utility"] += m.utility_output is not None
        kinds["failure"] += m.utility_output is not None and m.utility_output.failure_message is not None
    # The recording holds what the test says it compares.
    assert all(kinds.values()), kinds
    assert native >= len(recorded) // 2, (native, len(recorded))


@pytest.mark.parametrize("fields", [[None, []], [0, [], None, None]],
                         ids=["nil-engine_index", "nil-timestamp"])
def test_nil_in_non_optional_top_field_gives_vllms_error(fields: list[object]) -> None:
    """engine_index: int and timestamp: float take no None: vLLM's decoder raises."""
    raw = msgspec.msgpack.encode(fields)
    vllm, native, ours = decode_both([raw])
    assert vllm[0] == "raised"  # msgspec: Expected `int`/`float`, got `null`
    assert native[:2] == vllm[:2], (ours.native, native[2] if native[0] == "decoded" else native)


def test_a_top_level_field_past_vllms_layout_gives_vllms_answer() -> None:
    """One more top-level field than EngineCoreOutputs has: vLLM's decoder ignores it;
    the reader must not read it (the outputs sit where they belong, so only the field
    count can refuse it)."""
    n = len(EngineCoreOutputs.__struct_fields__)
    fields: list[object] = [0, [], None, 1.0] + [None] * (n - 4)
    vllm_fits, native_fits, ours_fits = decode_both([msgspec.msgpack.encode(fields)])
    assert vllm_fits[0] == "decoded" and ours_fits.native == 1
    assert native_fits[:2] == vllm_fits[:2]
    vllm, native, ours = decode_both([msgspec.msgpack.encode([*fields, None])])
    assert vllm[0] == "decoded" and ours.native == 0
    assert native[:2] == vllm[:2]


def test_negative_and_wide_integers_read_as_vllm_reads_them() -> None:
    """Every msgpack integer width, signed and unsigned, in token ids and a stop reason
    (hypothesis' common-shape messages draw non-negative ids only)."""
    ids = [-1, -32, -33, -100, -128, -129, -32768, -32769, -(2**31), -(2**31) - 1,
           127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32]
    for stop in (-100, -129, -(2**40), 2**40):
        msg = EngineCoreOutputs(outputs=[EngineCoreOutput(
            request_id="r", new_token_ids=ids, stop_reason=stop)])
        vllm, native, ours = decode_both(MsgpackEncoder().encode(msg))
        assert ours.native == 1
        assert native[:2] == vllm[:2]


def test_utility_reply_array_is_writable_as_vllms(monkeypatch: pytest.MonkeyPatch) -> None:
    """A utility reply carrying a small ndarray (collective_rpc with insecure
    serialization), in the zmq.Frame the output task hands the decoder: vLLM's
    decoder gives a writable array over the frame, and so does the native path,
    which hands vLLM's field decoder a writable copy of the field."""
    import zmq
    from vllm.v1.engine import EngineCoreOutputs, UtilityOutput
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder, UtilityResult

    from vllm_mmretry.receive import NativeOutputsDecoder

    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    msg = EngineCoreOutputs(outputs=[], timestamp=1.0,
                            utility_output=UtilityOutput(7, result=UtilityResult(np.arange(4, dtype=np.int32))))
    frames = [zmq.Frame(bytes(MsgpackEncoder().encode(msg)[0]))]
    want = MsgpackDecoder(EngineCoreOutputs).decode(frames).utility_output.result.result
    ours = NativeOutputsDecoder(MsgpackDecoder(EngineCoreOutputs), reader())
    got = ours.decode(frames).utility_output.result.result
    assert ours.native == 1
    assert (got == want).all()
    assert got.flags.writeable == want.flags.writeable, (got.flags.writeable, want.flags.writeable)
