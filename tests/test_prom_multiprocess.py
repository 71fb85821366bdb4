"""Native prometheus_client updates in multiprocess mode (`--api-server-count` > 1,
PROMETHEUS_MULTIPROC_DIR): values live in per-process files (`MmapedValue`), and
the stand-ins update them through the values' own `inc`/`set`.

Each test makes metrics with a fresh multiprocess value class writing to its own
directory (prometheus_client picks `values.ValueClass` when a metric is made, from
the environment at import; here it is set per test). Compared with stock: the
outcome of every call, the samples, what the multiprocess collector reads back
from the files, and, for vLLM's real PrometheusStatLogger, every `vllm:` sample
after the same generated stream of statistics."""

from __future__ import annotations

import os
import pathlib
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Gauge, multiprocess, values
from prometheus_client.mmap_dict import MmapedDict
from test_prom import KINDS, generated_twins, outcome, step_stats

from vllm_mmretry import _core, prom


class FileValues:
    """Metrics made while this is active store their values in files under `path`."""

    def __init__(self, path: pathlib.Path, process_identifier: Callable[[], Any] = os.getpid) -> None:
        self.path = path
        self.value_class = values.MultiProcessValue(process_identifier)

    def __enter__(self) -> FileValues:
        self._saved = values.ValueClass, os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        values.ValueClass = self.value_class
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(self.path)
        return self

    def __exit__(self, *exc: object) -> None:
        self.value_class.close_all_files()
        cls, env = self._saved
        values.ValueClass = cls
        if env is None:
            os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
        else:
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = env

    def collected(self, prefix: str = "") -> list[tuple[str, list[tuple[str, str]], str]]:
        """What vLLM's `/metrics` would read back from the files (no `_created`)."""
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, path=str(self.path))
        return sorted((s.name, sorted(s.labels.items()), repr(s.value))
                      for family in registry.collect() if family.name.startswith(prefix)
                      for s in family.samples if not s.name.endswith("_created"))


@pytest.fixture
def files() -> Iterator[FileValues]:
    with tempfile.TemporaryDirectory() as d, FileValues(pathlib.Path(d)) as fv:
        yield fv


def file_record(child: Any) -> list[tuple[float, float]]:
    """(value, timestamp) of each of the child's values, as stored in its file."""
    parts = [child._sum, *child._buckets] if hasattr(child, "_buckets") else [child._value]
    return [p._file.read_value(p._key) for p in parts]


@pytest.mark.parametrize("name", sorted(KINDS))
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_native_update_writes_what_prometheus_client_writes(name: str, data: st.DataObject) -> None:
    now = [1.0e9]  # time.time, for both sides: a "mostrecent" gauge stores it
    with (tempfile.TemporaryDirectory() as d, FileValues(pathlib.Path(d)) as fv,
          mock.patch.object(time, "time", lambda: now[0])):
        method, stock, fast, calls = generated_twins(name, data)
        for args, kwargs in calls:
            now[0] += 1.5
            want = outcome(getattr(stock, method), args, kwargs)
            got = outcome(getattr(fast, method), args, kwargs)
            assert got == want, (args, kwargs)
            assert prom.samples(fast) == prom.samples(stock), (args, kwargs)
            # Value and timestamp as stored in the file (the time only for "mostrecent").
            assert repr(file_record(fast)) == repr(file_record(stock)), (args, kwargs)
        read_back = {s[0].replace("_fast", "_stock"): s[1:] for s in fv.collected("t_") if "_fast" in s[0]}
        stock_side = {s[0]: s[1:] for s in fv.collected("t_") if "_stock" in s[0]}
        assert read_back == stock_side
        # Only a "mostrecent" gauge no call has set yet is not listed.
        assert stock_side or name == "gauge_mostrecent"


def test_multiprocess_children_update_through_their_own_values(files: FileValues) -> None:
    c = Counter("mp_own", "doc", registry=None)
    assert prom.updates_through_own_methods([c._value]) is True
    name, native = prom.fast_method(c)  # type: ignore[misc]
    assert name == "inc" and type(native) is _core.FastCounterInc
    setattr(c, name, native)
    c.inc(2)
    c.inc(0)
    assert files.collected("mp_own") == [("mp_own_total", [], "2.0")]
    # A value of another multiprocess class than the one metrics are made with: left alone.
    g = Gauge("mp_other", "doc", registry=None)
    g._value = values.MultiProcessValue()("gauge", "mp_other", "mp_other", (), (), "doc", multiprocess_mode="all")
    assert prom.fast_method(g) is None


def test_self_check_runs_in_multiprocess_mode_and_writes_no_files(files: FileValues) -> None:
    assert prom.multiprocess_values()
    assert prom.self_check.__wrapped__() is None
    assert prom.self_check.__wrapped__(own_methods=False) is None  # doctor's other form
    assert values.ValueClass is files.value_class
    assert not [s for s in files.collected() if "mmretry_check" in s[0]]
    assert not list(files.path.glob("*.db"))


def test_self_check_in_multiprocess_mode_catches_a_wrong_update(files: FileValues,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    class Twice:
        """Sets every gauge value twice as high."""

        def __init__(self, value: Any, original: Any, **kwargs: Any) -> None:
            self.original = original
            forms.append(kwargs["own_methods"])

        def __call__(self, value: Any) -> None:
            self.original()(value * 2)

    forms: list[bool] = []
    monkeypatch.setattr(_core, "FastGaugeSet", Twice)
    failure = prom.self_check.__wrapped__()
    assert failure is not None and failure.startswith("expected gauge(3,) ok")
    assert forms and all(forms)  # the form multiprocess values take: their own methods
    assert values.ValueClass is files.value_class


def test_native_updates_follow_a_fork_as_prometheus_client_does() -> None:
    """After the process identity changes (a fork), the next update resets the
    values and writes to the new process's file, natively as in stock."""
    pid = ["A"]
    with tempfile.TemporaryDirectory() as d, FileValues(pathlib.Path(d), lambda: pid[0]) as fv:
        twins = [Counter(f"mp_fork_{side}", "doc", registry=None) for side in ("stock", "fast")]
        setattr(twins[1], *prom.fast_method(twins[1]))  # type: ignore[misc]
        for c in twins:
            c.inc(2)
        pid[0] = "B"
        for c in twins:
            c.inc(3)
        per_file = {path.name: sorted((k, v) for k, v, _ts, _pos in
                                      MmapedDict.read_all_values_from_file(str(path)))
                    for path in fv.path.glob("*.db")}
        assert sorted(per_file) == ["counter_A.db", "counter_B.db"]
        for content in per_file.values():
            stock = [v for k, v in content if "mp_fork_stock" in k]
            assert stock and stock == [v for k, v in content if "mp_fork_fast" in k]
        assert [s for s in fv.collected("mp_fork") if s[0].endswith("_total")] == [
            ("mp_fork_fast_total", [], "5.0"), ("mp_fork_stock_total", [], "5.0")]


def multiprocess_vllm_samples(vllm_config: Any, stream: list[Any], fast: bool) -> list[Any]:
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    with tempfile.TemporaryDirectory() as d, FileValues(pathlib.Path(d)) as fv:
        logger = PrometheusStatLogger(vllm_config, engine_indexes=[0])
        if fast:
            patched = prom.speed_up([logger])
            assert len(patched) > 20
        for sched, its in stream:
            logger.record(scheduler_stats=sched, iteration_stats=its, engine_idx=0)
        return fv.collected("vllm:")


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(stream=st.lists(step_stats(), min_size=1, max_size=20))
def test_vllms_stat_logger_writes_stock_files(vllm_config: Any, stream: list[Any]) -> None:
    """vLLM's real PrometheusStatLogger in multiprocess mode: what `/metrics` reads
    back from the files is stock's, sample for sample."""
    stock = multiprocess_vllm_samples(vllm_config, stream, fast=False)
    assert stock
    assert multiprocess_vllm_samples(vllm_config, stream, fast=True) == stock
