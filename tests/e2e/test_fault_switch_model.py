"""The fault switch against stock vLLM, in process (no server): vLLM's real
LruKeyReplicatedReceiverCache driven by hypothesis-generated lookup sequences, once
through vLLM's own method and once through the switch's wrapper of it (the class
itself is not patched here)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_mmretry import faults

torch = pytest.importorskip("torch")

HASHES = ["h0", "h1", "h2"]
# A lookup: (hash, carries data?)
lookups = st.lists(st.tuples(st.sampled_from(HASHES), st.booleans()), max_size=40)


@pytest.fixture(scope="module")
def env(model: str) -> dict[str, Any]:
    from vllm.config import ModelConfig
    from vllm.multimodal.cache.base import MultiModalCacheMissError
    from vllm.multimodal.cache.lru import LruKeyReplicatedReceiverCache
    from vllm.multimodal.inputs import (
        MultiModalBatchedField,
        MultiModalFieldElem,
        MultiModalKwargsItem,
    )

    config = ModelConfig(model=model, mm_processor_cache_gb=0.01)
    items = {h: MultiModalKwargsItem({"pixel_values": MultiModalFieldElem(
        data=torch.full((3, 4, 4), float(i)), field=MultiModalBatchedField())})
        for i, h in enumerate(HASHES)}
    return {"new": lambda: LruKeyReplicatedReceiverCache(config), "items": items,
            "miss": MultiModalCacheMissError, "stock": LruKeyReplicatedReceiverCache.get_and_update_item,
            "faulty": faults.faulty_get_and_update_item()}


def _run(env: dict[str, Any], method: Callable[..., Any], seq: list[tuple[str, bool]]) -> list[str]:
    cache, out = env["new"](), []
    for h, data in seq:
        try:
            item = method(cache, env["items"][h] if data else None, h)
            out.append(f"ok:{float(item['pixel_values'].data[0, 0, 0]):g}")
        except env["miss"] as e:
            out.append(f"miss:{','.join(e.mm_hashes)}")
    return out


@pytest.fixture(scope="module")
def plan() -> Iterator[Callable[[str], None]]:
    """Activate a plan for the switch's wrapper; fresh counters on each call."""
    yield lambda spec: faults.activate(faults.parse(spec))
    faults.activate(None)


@settings(max_examples=60, deadline=None)
@given(seq=lookups)
def test_off_or_p0_is_stock(env: dict[str, Any], plan: Any, seq: list[tuple[str, bool]]) -> None:
    stock = _run(env, env["stock"], seq)
    faults.activate(None)
    assert _run(env, env["faulty"], seq) == stock
    plan("p1_miss=prob:0:seed:1")
    assert _run(env, env["faulty"], seq) == stock


@settings(max_examples=60, deadline=None)
@given(seq=lookups, n=st.integers(1, 4))
def test_every_n_misses_exactly_the_nth_hits(env: dict[str, Any], plan: Any,
                                             seq: list[tuple[str, bool]], n: int) -> None:
    stock = _run(env, env["stock"], seq)
    plan(f"p1_miss=every:{n}")
    got = _run(env, env["faulty"], seq)
    # Replay: a no-data lookup of a present entry is hit #k; the switch drops it
    # when k % n == 0, after which the hash stays missing until data arrives.
    present: set[str] = set()
    hits = 0
    for (h, data), s, g in zip(seq, stock, got, strict=True):
        if data:
            present.add(h)
            assert g == s
        elif h in present:
            hits += 1
            if hits % n == 0:
                present.discard(h)
                assert g == f"miss:{h}"
            else:
                assert g.startswith("ok:")
        else:
            assert g == f"miss:{h}"
    assert faults.stats() == {"hit_lookups": hits, "drops": hits // n}


@settings(max_examples=60, deadline=None)
@given(seq=lookups)
def test_retry_miss_fails_each_dropped_hashs_first_resend_once(
        env: dict[str, Any], plan: Any, seq: list[tuple[str, bool]]) -> None:
    plan("p1_miss=every:1,retry_miss=1")
    got = _run(env, env["faulty"], seq)
    present: set[str] = set()
    pending: set[str] = set()  # dropped, re-send not yet failed
    for (h, data), g in zip(seq, got, strict=True):
        if data and h in pending:
            pending.discard(h)
            assert g == f"miss:{h}"
        elif data:
            present.add(h)
            assert g.startswith("ok:")
        elif h in present:
            present.discard(h)
            pending.add(h)
            assert g == f"miss:{h}"
        else:
            assert g == f"miss:{h}"
