"""Test-only: records the engine-output messages an API server decodes.

Imported at start-up when this folder is on PYTHONPATH (tests/e2e_033/test_recorded_033.py
puts it there). With VLLM_MMRETRY_TEST_RECORD_DIR set, a daemon thread waits until the
plugin's receive module is loaded (it imports nothing itself) and wraps
`NativeOutputsDecoder.decode`, which sees every message when VLLM_MMRETRY_NATIVE_DECODE=1:
each call's frames go to `<dir>/<pid>.jsonl` as one JSON list of base64 strings.
"""
import os

_DIR = os.environ.get("VLLM_MMRETRY_TEST_RECORD_DIR")


def _start() -> None:
    import base64
    import functools
    import json
    import sys
    import threading
    import time

    def wrap(cls: type) -> None:
        orig = cls.__dict__["decode"]
        out = open(os.path.join(_DIR, f"{os.getpid()}.jsonl"), "a", buffering=1)

        @functools.wraps(orig)
        def recording(self, bufs):  # type: ignore[no-untyped-def]
            frames = [bufs] if isinstance(bufs, (bytes, bytearray, memoryview)) else bufs
            out.write(json.dumps([base64.b64encode(bytes(f)).decode() for f in frames]) + "\n")
            return orig(self, bufs)

        cls.decode = recording

    def run() -> None:
        while True:
            cls = getattr(sys.modules.get("vllm_mmretry.receive"), "NativeOutputsDecoder", None)
            if isinstance(cls, type):
                wrap(cls)
                return
            time.sleep(0.01)

    threading.Thread(target=run, name="record-engine-outputs", daemon=True).start()


if _DIR:
    _start()
