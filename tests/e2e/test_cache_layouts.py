"""Cache layouts where vLLM 0.32 builds no droppable P1 entry, with the fault switch on.

- `--api-server-count 2`: every process uses MultiModalProcessorOnlyCache and the
  engine builds no receiver cache, so P0/P1 drift cannot happen and the switch has
  nothing to drop: recovery "works" trivially. We assert 200 and identical output
  whichever API server answers, and that the log says why nothing was dropped.
- `--mm-processor-cache-type shm` (one API server): the worker's
  ShmObjectStoreReceiverCache only reads shared memory P0 wrote (P0 is the single
  writer and knows exactly what is there), so it owns no entry to drop either."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import pytest
from e2e_helpers import (
    ENGINE_MISS,
    FAULT_DROP,
    chat_body,
    client,
    image_url,
    mark,
    servers,
    start_server,
)

pytestmark = pytest.mark.e2e

FAULTS = {"VLLM_MMRETRY_FAULTS": "p1_miss=every:1"}


def _answers(server: servers.Server, model: str, rgb: tuple[int, int, int], times: int) -> list[str]:
    body = chat_body(model, image_url(rgb))
    out = []
    with client(server) as http:
        for _ in range(times):
            # A fresh connection each time, so the kernel may hand it to either
            # API server (they share the listening socket).
            r = http.post("/v1/chat/completions", json=body, headers={"Connection": "close"})
            assert r.status_code == 200, r.text
            out.append(r.json()["choices"][0]["message"]["content"])
    return out


@pytest.fixture(scope="class")
def shm_server(model: str) -> Iterator[servers.Server]:
    yield from start_server(model, "--mm-processor-cache-type", "shm", env=FAULTS)


class TestTwoApiServers:
    @pytest.fixture
    def server(self, two_api_servers: servers.Server) -> servers.Server:
        return two_api_servers

    def test_log_shows_no_receiver_cache(self, server: servers.Server) -> None:
        log = server.log()
        assert "mm processor cache type 'processor_only'" in log
        assert "mm processor cache type 'lru'" not in log
        # Both API servers loaded the plugin and the switch.
        api_pids = set(re.findall(r"\((?:APIServer|ApiServer)\w* pid=(\d+)\).*TEST FAULT SWITCH ON", log))
        assert len(api_pids) == 2, api_pids

    def test_repeated_image_gives_identical_output_on_either_server(
            self, server: servers.Server, model: str) -> None:
        window = mark(server)
        answers: list[str] = []
        served_by: set[str] = set()
        # Fresh connections until both API servers have answered (they share the
        # listening socket; the kernel picks one per connection).
        while len(served_by) < 2 and len(answers) < 40:
            answers += _answers(server, model, (51, 0, 51), times=4)
            time.sleep(0.2)
            served_by = set(re.findall(r"\((\w+) pid=\d+\)[^\n]*Added request", window.text()))
        assert served_by == {"ApiServer_0", "ApiServer_1"}, (served_by, len(answers))
        assert len(set(answers)) == 1 and answers[0]
        text = window.text()
        assert FAULT_DROP not in text and ENGINE_MISS not in text


class TestShmOneApiServer:
    @pytest.fixture
    def server(self, shm_server: servers.Server) -> servers.Server:
        return shm_server

    def test_log_shows_shm_receiver(self, server: servers.Server) -> None:
        assert "mm processor cache type 'shm'" in server.log()

    def test_repeated_image_gives_identical_output(self, server: servers.Server, model: str) -> None:
        window = mark(server)
        answers = _answers(server, model, (52, 0, 52), times=4)
        assert len(set(answers)) == 1 and answers[0]
        text = window.text()
        assert FAULT_DROP not in text and ENGINE_MISS not in text
