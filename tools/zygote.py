"""A warm Python for tests that start many short interpreters (test harness only).

The doctor and plugin tests start a fresh interpreter per case, as `vllm-mmretry
doctor` and `vllm serve` do, and most of each start is `import vllm` (torch,
transformers). The zygote imports vLLM's package once and forks a child per run. The
child takes the run's environment, argv, working directory and output files, and
imports everything else itself: this package, vLLM's engine and entry points, the
plugin (`load_general_plugins` runs in the child).

A run forks only when nothing the preload read can differ: its environment may differ
from the zygote's only in VLLM_* and TORCHINDUCTOR_* variables the preload did not read
(Python code reads them when it needs them) and in pytest's PYTEST_CURRENT_TEST. Any
other difference (PYTHONPATH, a sitecustomize, HF_*, a VLLM_LOGGING_* variable) runs a
real fresh interpreter.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import select
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

# vLLM's package as `import vllm` loads it (torch with it), and libraries vLLM imports
# later: the two heaviest, and cv2, whose import sets LD_LIBRARY_PATH (so a test process
# that imported it compares equal).
PRELOAD = ("vllm", "transformers", "openai", "cv2")
# Names a run may change, when the preload did not read them: names only Python code
# reads (vLLM's own, through `vllm.envs`; torch's inductor settings, one of which vLLM's
# compilation modules set in a process that imports them) and pytest's
# PYTEST_CURRENT_TEST. Others can be read by native code at start-up (the loader,
# OpenMP, the interpreter), where the recorder cannot see.
LAZY_PREFIXES = ("VLLM_", "TORCHINDUCTOR_", "PYTEST_")


# --- The zygote process -------------------------------------------------------------

@contextlib.contextmanager
def _recording_reads() -> Iterator[set[str]]:
    """The names os.environ is read by while the block runs."""
    read: set[str] = set()
    kind = type(os.environ)
    original = {name: getattr(kind, name) for name in ("__getitem__", "__iter__")}

    def recorder(name: str) -> Any:  # get() and `in` go through __getitem__
        def read_through(self: Any, *args: Any) -> Any:
            caller = sys._getframe(1)
            scan = not args or caller.f_code.co_name == "__iter__"  # also items(), values()
            read.add(_scanner(caller) if scan else str(args[0]))
            return original[name](self, *args)
        return read_through

    for name in original:
        setattr(kind, name, recorder(name))
    try:
        yield read
    finally:
        for name, method in original.items():
            setattr(kind, name, method)


def _preload() -> tuple[set[str], dict[str, str], list[str]]:
    """Import PRELOAD; return the names read meanwhile and what the imports set/removed."""
    before = dict(os.environ)
    early = any(module in sys.modules for module in PRELOAD)
    with _recording_reads() as read:
        for module in PRELOAD:
            __import__(module)
    if early:  # a .pth file imported vLLM at start-up, before the recorder was in
        read |= _reads_of_a_fresh_start()
    changed = {k: v for k, v in os.environ.items() if before.get(k) != v}
    removed = [k for k in before if k not in os.environ]
    return read, changed, removed


def _reads_of_a_fresh_start() -> set[str]:
    """What a start-up and the preload read, recorded in a `python -S` run that processes
    the .pth files itself once its recorder is in (for an environment where a .pth file
    imports vLLM, whose reads at start-up the zygote itself cannot see)."""
    code = (f"import sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})\n"
            "import zygote; zygote.print_reads_of_a_start()")
    out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True,
                         timeout=300, check=True)
    return set(json.loads(out.stdout.splitlines()[-1]))


def print_reads_of_a_start() -> None:
    """In the `python -S` run: site's start-up and the preload, recorded."""
    with _recording_reads() as read:
        import site

        site.main()
        for module in PRELOAD:
            __import__(module)
    print(json.dumps(sorted(read)))


def _scanner(frame: Any) -> str:
    """Who iterates the environment: "*" for vLLM (then every VLLM_* name counts as
    read), "*module" for others (tqdm, networkx scan their own prefixes)."""
    while frame is not None and frame.f_globals.get("__name__", "") in (
            "_collections_abc", "collections.abc", "os", __name__):
        frame = frame.f_back
    module = frame.f_globals.get("__name__", "") if frame is not None else ""
    return "*" if module.split(".")[0] == "vllm" else f"*{module}"


def _run_child(request: dict[str, Any], changed: dict[str, str], removed: list[str]) -> None:
    """In the forked child: become the requested interpreter run, then run it."""
    import runpy
    import types

    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(out, fd)
        os.close(out)
    env = {**request["env"], **changed}
    for name in removed:
        env.pop(name, None)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(request["cwd"])
    mode, target, *rest = request["args"]
    main = types.ModuleType("__main__")
    sys.modules["__main__"] = main
    if mode == "-c":
        sys.argv = ["-c", *rest]
        sys.path[0] = ""
        exec(compile(target, "<string>", "exec"), main.__dict__)
    else:  # -m
        sys.argv = [target, *rest]
        sys.path[0] = os.getcwd()
        runpy.run_module(target, run_name="__main__", alter_sys=True)


def serve() -> int:
    """Read one JSON request per line; fork, wait, and answer the pid then the status."""
    requests = os.fdopen(os.dup(0), "r")
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # what the preload prints must not reach the answers
    read, changed, removed = _preload()
    gc.freeze()  # the children's collections then skip the preloaded objects
    answers.write(json.dumps({"read": sorted(read), "set": changed, "unset": removed}) + "\n")
    answers.flush()
    for line in requests:
        request = json.loads(line)
        answers.flush()
        pid = os.fork()
        if pid == 0:
            requests.close()
            answers.close()
            _run_child(request, changed, removed)
            return 0  # then the interpreter's own shutdown: atexit, threads, flush
        answers.write(json.dumps({"pid": pid}) + "\n")
        answers.flush()
        _, status = os.waitpid(pid, 0)
        answers.write(json.dumps({"status": os.waitstatus_to_exitcode(status)}) + "\n")
        answers.flush()
    return 0


# --- The client (a pytest worker) ---------------------------------------------------

class Zygote:
    """One zygote per process (pytest worker); runs are one at a time."""

    def __init__(self, python: str = sys.executable) -> None:
        self.python = python
        self.env = dict(os.environ)
        self.proc = subprocess.Popen([python, __file__], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=self.env)
        self.pending = b""
        ready = self._answer(timeout=300)
        self.read = set(ready["read"])
        # What the preload sets (vLLM's env_override sets a few variables): a run may
        # leave them out (its own import sets them) or carry them from a process that
        # imported vLLM.
        self.preload_set: dict[str, str] = ready["set"]
        for name in ready["unset"]:
            self.env.pop(name, None)
        self.env.update(self.preload_set)
        self.lock = threading.Lock()

    def _answer(self, timeout: float) -> dict[str, Any]:
        """The zygote's next line (read from the raw pipe: two may arrive together)."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self.pending:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise TimeoutError
            chunk = os.read(fd, 65536)
            if not chunk:
                raise RuntimeError(f"the zygote exited ({self.proc.poll()})")
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return json.loads(line)

    def forkable(self, args: Sequence[str], env: Mapping[str, str]) -> bool:
        """True when a fork of the preloaded zygote is the same as a fresh interpreter."""
        return self.why_fresh(args, env) is None

    def why_fresh(self, args: Sequence[str], env: Mapping[str, str]) -> str | None:
        """Why this run needs a fresh interpreter, or None."""
        if not args or args[0] not in ("-c", "-m"):
            return "not -c or -m"
        if "*" in self.read:
            return "vLLM read the whole environment while it was imported"
        differ = {k for k in set(env) | set(self.env) if env.get(k) != self.env.get(k)
                  and not (k in self.preload_set and k not in env)}
        refused = sorted(k for k in differ if not k.startswith(LAZY_PREFIXES) or k in self.read)
        return f"the environment differs in {refused}" if refused else None

    def run(self, args: Sequence[str], env: Mapping[str, str], timeout: float,
            cwd: str | None = None) -> subprocess.CompletedProcess[str]:
        """What `subprocess.run([python, *args], capture_output=True, text=True)` gives."""
        why = self.why_fresh(args, env)
        if why and os.environ.get("ZYGOTE_TRACE"):
            test = os.environ.get("PYTEST_CURRENT_TEST")
            print(f"zygote: {test}: a fresh interpreter: {why}", file=sys.stderr)
        if why or self.proc.poll() is not None:
            return subprocess.run([self.python, *args], capture_output=True, text=True,
                                  timeout=timeout, env=dict(env), cwd=cwd)
        with self.lock, tempfile.TemporaryDirectory() as tmp:
            out, err = os.path.join(tmp, "out"), os.path.join(tmp, "err")
            assert self.proc.stdin is not None
            self.proc.stdin.write((json.dumps({"args": list(args), "env": dict(env),
                                               "cwd": cwd or os.getcwd(),
                                               "stdout": out, "stderr": err}) + "\n").encode())
            self.proc.stdin.flush()
            pid = self._answer(timeout=60)["pid"]
            try:
                status = self._answer(timeout=timeout)["status"]
            except TimeoutError:
                os.kill(pid, 9)
                self._answer(timeout=60)
                raise subprocess.TimeoutExpired([self.python, *args], timeout) from None
            return subprocess.CompletedProcess([self.python, *args], status,
                                               _text(out), _text(err))

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


def _text(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


_shared: Zygote | None = None


def shared() -> Zygote:
    """This process's zygote, started on first use and closed at exit."""
    global _shared
    if _shared is None:
        import atexit

        _shared = Zygote()
        atexit.register(_shared.close)
    return _shared


if __name__ == "__main__":
    sys.exit(serve())
