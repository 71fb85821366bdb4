"""A headless vLLM front end (through our launcher) with vLLM's mock engine behind it.

The front end runs as `vllm-mmretry serve MODEL ... --data-parallel-size 1
--data-parallel-size-local 0 --data-parallel-address 127.0.0.1 --data-parallel-rpc-port P`:
it binds the handshake socket on P and waits for an engine. The mock engine
(`make mock-engine` builds it into .cache/mock-engine/, `make mock-engine-034` the one of
vLLM 0.34.0 into .cache/mock-engine-0.34.0/; `servers.mock_dir()` picks) joins that handshake; it gives up
after 5 s when the socket is not there yet, so it is started once the front end listens
on P, and restarted if it exits before the front end is healthy. Both processes run in
process groups of their own and are always killed on exit.

Used with vLLM 0.33 and 0.34 (.venv-033, .venv-034), whose engine cannot run a model on this machine: the
front end is real (HTTP, renderer, P0 multimodal cache, output processor, the plugin
through its entry point); tokens come from the mock engine."""

from __future__ import annotations

import contextlib
import os
import pathlib
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import servers

MOCK_DIR = servers.mock_dir()
MOCK_ENGINE = MOCK_DIR / "vllm-mock-engine"

ENGINE_START_ATTEMPTS = 20


@dataclass
class MockServed:
    """A running front end (`front`, a servers.Server) and its mock engine."""

    front: servers.Server
    engine: subprocess.Popen
    engine_log_path: pathlib.Path

    @property
    def base_url(self) -> str:
        return self.front.base_url

    @property
    def openai_url(self) -> str:
        return self.front.openai_url

    def front_log(self) -> str:
        return self.front.log()

    def engine_log(self) -> str:
        return self.engine_log_path.read_text(errors="replace")


def _fail(front: servers.Server, engine_log: pathlib.Path | None, why: str) -> RuntimeError:
    tail = front.log()[-4000:]
    if engine_log is not None and engine_log.exists():
        tail += "\n--- mock engine log ---\n" + engine_log.read_text(errors="replace")[-2000:]
    return RuntimeError(f"{why}; log tail:\n{tail}")


def _kill_group(proc: subprocess.Popen) -> None:
    servers.stop(servers.Server("", pathlib.Path(os.devnull), proc.pid, proc))


def _start_engine(rpc_port: int, env: dict[str, str], log_path: pathlib.Path,
                  engine_args: list[str]) -> subprocess.Popen:
    cmd = [str(MOCK_ENGINE), "--handshake-address", f"tcp://127.0.0.1:{rpc_port}",
           *engine_args]
    with open(log_path, "ab") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env, start_new_session=True)


def _wait_listening(front: servers.Server, port: int, deadline: float) -> None:
    while servers.listen_queue(port) is None:
        if front.proc.poll() is not None:
            raise _fail(front, None, f"front end exited with {front.proc.returncode}")
        if time.monotonic() > deadline:
            raise _fail(front, None, f"front end not listening on {port}")
        time.sleep(0.2)


def _engine_until_healthy(front: servers.Server, rpc_port: int, env: dict[str, str],
                          log_path: pathlib.Path, engine_args: list[str],
                          deadline: float) -> subprocess.Popen:
    """Start the mock engine, restart it while it gives up early, and return it once
    the front end answers /health."""
    engine = _start_engine(rpc_port, env, log_path, engine_args)
    attempts = 1
    try:
        while True:
            if front.proc.poll() is not None:
                raise _fail(front, log_path, f"front end exited with {front.proc.returncode}")
            if engine.poll() is not None:
                if attempts >= ENGINE_START_ATTEMPTS:
                    raise _fail(front, log_path, f"mock engine exited {attempts} times")
                engine = _start_engine(rpc_port, env, log_path, engine_args)
                attempts += 1
            if servers.healthy(front):
                return engine
            if time.monotonic() > deadline:
                raise _fail(front, log_path, "front end not healthy in time")
            time.sleep(0.5)
    except BaseException:
        _kill_group(engine)
        raise


@contextlib.contextmanager
def serve_with_mock_engine(model: str | os.PathLike, *args: str,
                           env: dict[str, str] | None = None,
                           engine_args: tuple[str, ...] = (),
                           timeout: float = 240.0) -> Iterator[MockServed]:
    """Run the headless front end and the mock engine until the block exits."""
    if not MOCK_ENGINE.exists():
        raise FileNotFoundError(f"{MOCK_ENGINE} is missing: run `make {servers.mock_make_target()}`")
    port, rpc_port = servers.free_port(), servers.free_port()
    log_dir = servers.ROOT / ".cache" / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    stamp = f"{port}-{int(time.time())}"
    front_log = log_dir / f"serve-headless-{stamp}.log"
    engine_log = log_dir / f"mock-engine-{stamp}.log"
    full_env = servers.server_env(env)
    cmd = [sys.executable, "-m", "vllm_mmretry.cli", "serve", str(model),
           "--host", "127.0.0.1", "--port", str(port), *servers.TINY_SERVE_ARGS,
           "--data-parallel-size", "1", "--data-parallel-size-local", "0",
           "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", str(rpc_port),
           *args]
    with open(front_log, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=full_env,
                                start_new_session=True)
    front = servers.Server(f"http://127.0.0.1:{port}", front_log, proc.pid, proc)
    try:
        deadline = time.monotonic() + timeout
        _wait_listening(front, rpc_port, deadline)
        engine = _engine_until_healthy(front, rpc_port, full_env, engine_log,
                                       list(engine_args), deadline)
        try:
            yield MockServed(front, engine, engine_log)
        finally:
            _kill_group(engine)
    finally:
        servers.stop(front)
