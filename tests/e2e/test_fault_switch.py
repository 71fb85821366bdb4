"""The fault switch itself: parsing, what it does to vLLM's real
LruKeyReplicatedReceiverCache (in a fresh interpreter, since patches are per
process), and that `vllm serve` refuses an invalid value."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from e2e_helpers import servers

from vllm_mmretry import faults


@pytest.mark.parametrize("spec,expected", [
    ("", None),
    ("  ", None),
    ("p1_miss=every:3", faults.FaultPlan("p1_miss=every:3", every=3)),
    ("p1_miss=prob:0.25:seed:9", faults.FaultPlan("p1_miss=prob:0.25:seed:9", prob=0.25, seed=9)),
    ("p1_miss=every:1, retry_miss=1",
     faults.FaultPlan("p1_miss=every:1, retry_miss=1", every=1, retry_miss=True)),
])
def test_parse_valid(spec: str, expected: faults.FaultPlan | None) -> None:
    assert faults.parse(spec) == expected


@pytest.mark.parametrize("spec", [
    "p1_miss", "p1_miss=every:0", "p1_miss=every:-1", "p1_miss=every:x", "p1_miss=every",
    "p1_miss=prob:1.5:seed:1", "p1_miss=prob:nan:seed:1", "p1_miss=prob:0.5",
    "p1_miss=prob:0.5:sed:1", "retry_miss=1", "p1_miss=every:1,retry_miss=2",
    "p1_miss=every:1,p1_miss=every:2", "p1_miss=every:1,other=1", "p1_miss=every:1,",
])
def test_parse_invalid(spec: str) -> None:
    with pytest.raises(faults.FaultConfigError, match="VLLM_MMRETRY_FAULTS"):
        faults.parse(spec)


D, H = True, False  # a lookup carrying data / a cache-hit lookup without data

# (spec, lookups) cases, all run in one fresh interpreter (patches are per process;
# each case restores vLLM and installs the switch anew).
CASES: dict[str, tuple[str, list[bool]]] = {
    "every2": ("p1_miss=every:2", [D, H, H, H, H]),
    "every1": ("p1_miss=every:1", [D, H, D, H, D]),
    "retry": ("p1_miss=every:1,retry_miss=1", [D, H, D, D, H]),
    "prob_a": ("p1_miss=prob:0.5:seed:3", [D] + [H, D] * 20),
    "prob_b": ("p1_miss=prob:0.5:seed:3", [D] + [H, D] * 20),
    "prob_0": ("p1_miss=prob:0:seed:3", [D] + [H, D] * 20),
    "prob_1": ("p1_miss=prob:1:seed:3", [D] + [H, D] * 20),
}

# Drives vLLM's real receiver cache (built from a real ModelConfig of the tiny
# model) through the patched method and prints what happened per lookup.
PROBE = """
    import json, os, sys, torch
    from vllm.config import ModelConfig
    from vllm.multimodal.cache.base import MultiModalCacheMissError
    from vllm.multimodal.cache.lru import LruKeyReplicatedReceiverCache
    from vllm.multimodal.inputs import (MultiModalBatchedField, MultiModalFieldElem,
                                        MultiModalKwargsItem)
    from vllm_mmretry import _patching, faults

    config = ModelConfig(model=sys.argv[1], mm_processor_cache_gb=0.01)
    item = MultiModalKwargsItem({"pixel_values": MultiModalFieldElem(
        data=torch.zeros(3, 4, 4), field=MultiModalBatchedField())})
    results = {}
    for name, (spec, lookups) in json.loads(sys.argv[2]).items():
        _patching.restore_all(); faults._reset_for_tests()
        os.environ[faults.ENV] = spec
        labels = faults.install()
        cache = LruKeyReplicatedReceiverCache(config)
        events = []
        for data in lookups:
            try:
                cache.get_and_update_item(item if data else None, "h")
                events.append("ok")
            except MultiModalCacheMissError:
                events.append("miss")
        results[name] = {"labels": labels, "events": events, "stats": faults.stats()}
    print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def probed(model: str) -> dict[str, dict]:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(PROBE), model, json.dumps(CASES)],
                         capture_output=True, text=True, timeout=300, env=servers.server_env())
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_every_n_drops_every_nth_hit_lookup(probed: dict[str, dict]) -> None:
    r = probed["every2"]
    # hit #1 ok, hit #2 dropped -> miss, then the entry is gone: a natural miss
    # (not counted as a hit lookup), and so on.
    assert r["events"] == ["ok", "ok", "miss", "miss", "miss"]
    assert r["stats"] == {"hit_lookups": 2, "drops": 1}
    assert any("LruKeyReplicatedReceiverCache.get_and_update_item" in lb for lb in r["labels"])


def test_every_1_then_resend_repopulates(probed: dict[str, dict]) -> None:
    r = probed["every1"]
    assert r["events"] == ["ok", "miss", "ok", "miss", "ok"]
    assert r["stats"] == {"hit_lookups": 2, "drops": 2}


def test_retry_miss_fails_the_first_resend_once(probed: dict[str, dict]) -> None:
    assert probed["retry"]["events"] == ["ok", "miss", "miss", "ok", "miss"]


def test_prob_is_seeded(probed: dict[str, dict]) -> None:
    a, b = probed["prob_a"], probed["prob_b"]
    assert a == b and 0 < a["stats"]["drops"] < 20
    assert probed["prob_0"]["stats"]["drops"] == 0
    assert probed["prob_1"]["stats"]["drops"] == 20


def test_unset_patches_nothing() -> None:
    env = {k: v for k, v in os.environ.items() if k != faults.ENV}
    out = subprocess.run([sys.executable, "-c",
                          "from vllm_mmretry import faults, _patching; "
                          "print(faults.install(), len(_patching._originals))"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.stdout.strip().splitlines()[-1] == "[] 0", out.stderr[-2000:]


@pytest.mark.e2e
def test_vllm_serve_refuses_an_invalid_value(model: str) -> None:
    cmd = [sys.executable, "-m", "vllm_mmretry.cli", "serve", model, "--host", "127.0.0.1",
           "--port", str(servers.free_port()), *servers.TINY_SERVE_ARGS]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                         env=servers.server_env({faults.ENV: "p1_miss=sometimes"}),
                         stdin=subprocess.DEVNULL)
    assert out.returncode != 0
    assert "invalid VLLM_MMRETRY_FAULTS='p1_miss=sometimes'" in out.stdout + out.stderr
