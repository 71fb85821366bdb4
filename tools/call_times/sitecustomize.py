"""Per-call accounting of an API server's engine-output work, for `bench_serve.py --call-times`.

Imported at start-up when this folder is on PYTHONPATH (bench_serve puts it there only
with --call-times). With BENCH_CALL_TIMES_DIR set, a daemon thread waits until vLLM's
modules are loaded (it imports nothing itself), wraps the functions below with a counter
and a timer, and writes `<dir>/<pid>.json` every 0.2 s: {name: [calls, outputs, seconds]}
plus the process's CPU seconds. It also counts what vLLM's output handler finds when it
asks the engine client for the next message (`get_output_async`):
"output_queue": [asks, messages already waiting summed over the asks, asks that found
none waiting], so a run gives the handler's mean backlog and how many messages it works
through between two moments it has caught up. The timer is the calling thread's CPU time
(`time.thread_time`), not wall time: a call that waits for the GIL while the renderer's
tokenizer threads hold it, or for a core the mock engine has, would otherwise count that
wait. Each wrapped call costs about a microsecond more (two clock reads).
"""
import os

_DIR = os.environ.get("BENCH_CALL_TIMES_DIR")

# (module, class, method, name): the per-engine-message work of the API server.
_TARGETS = (
    ("vllm.v1.serial_utils", "MsgpackDecoder", "decode", "decode"),
    ("vllm.v1.engine.output_processor", "OutputProcessor", "process_outputs", "process_outputs"),
    # the plugin's (its fallback calls vLLM's for some requests, counted apart above)
    ("vllm_mmretry.output_processor", "OutputProcessor", "process_outputs", "plugin.process_outputs"),
    ("vllm.v1.metrics.loggers", "StatLoggerManager", "record", "record"),
)
# The engine client whose queue the output handler reads (vLLM 0.32 and 0.33).
_QUEUE_TARGET = ("vllm.v1.engine.core_client", "AsyncMPClient", "get_output_async")


def _start() -> None:
    import functools
    import json
    import sys
    import threading
    import time

    acc: dict[str, list[float]] = {}

    def wrap(cls: type, method: str, name: str) -> None:
        orig = cls.__dict__[method]

        @functools.wraps(orig)
        def timed(*args, **kwargs):  # type: ignore[no-untyped-def]
            t0 = time.thread_time()
            try:
                return orig(*args, **kwargs)
            finally:
                a = acc.setdefault(name, [0, 0, 0.0])
                a[0] += 1
                if name.endswith("process_outputs") and len(args) > 1:
                    a[1] += len(args[1])
                a[2] += time.thread_time() - t0

        setattr(cls, method, timed)

    def count_queue(cls: type, method: str) -> None:
        orig = cls.__dict__[method]
        a = acc.setdefault("output_queue", [0, 0, 0])

        @functools.wraps(orig)
        async def counted(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            queue = getattr(self, "outputs_queue", None)
            waiting = queue.qsize() if queue is not None else 0
            a[0] += 1
            a[1] += waiting
            a[2] += waiting == 0
            return await orig(self, *args, **kwargs)

        setattr(cls, method, counted)

    def run() -> None:
        # (module, class, method, how to wrap it), each wrapped once its class is loaded
        pending = [(m, c, meth, functools.partial(wrap, name=name)) for m, c, meth, name in _TARGETS]
        pending.append((*_QUEUE_TARGET, count_queue))
        path = os.path.join(_DIR, f"{os.getpid()}.json")
        while True:
            for t in list(pending):
                module, cls_name, method, install = t
                cls = getattr(sys.modules.get(module), cls_name, None)
                if isinstance(cls, type) and method in cls.__dict__:
                    install(cls, method)
                    pending.remove(t)
            cpu = os.times()
            calls = {k: list(v) for k, v in list(acc.items())}  # list(): one step under the GIL
            tmp = path + ".tmp"
            with open(tmp, "w") as f:
                json.dump({"cpu": cpu.user + cpu.system, "calls": calls}, f)
            os.replace(tmp, path)
            time.sleep(0.2)

    threading.Thread(target=run, name="bench-call-times", daemon=True).start()


if _DIR:
    _start()
