"""`vllm-mmretry doctor` as an operator runs it (a fresh interpreter through the CLI):
on the tiny LLaVA model (lru layout; processor_only with two API servers; shm; cache
off), on the Tekken vocabulary folder, text and JSON, and exit status 1 when vLLM's
version is not supported or VLLM_PLUGINS leaves the plugin out."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest

from vllm_mmretry import vllm_adapter
from vllm_mmretry.vllm_adapter import installed_vllm_version

PY = sys.executable
# vLLM's version faked before the doctor asks for it (the way test_plugin fakes it).
FAKE_VERSION = textwrap.dedent("""
    import sys, vllm
    vllm.__version__ = "0.31.9"
    sys.argv = ["vllm-mmretry", *sys.argv[1:]]
    from vllm_mmretry.cli import main
    main()
""")


def doctor(*args: str, code: str | None = None, **env: str) -> subprocess.CompletedProcess[str]:
    cmd = [PY, "-c", code, *args] if code else [PY, "-m", "vllm_mmretry.cli", *args]
    return subprocess.run(["env", "-u", "VLLM_PLUGINS", *cmd] if "VLLM_PLUGINS" not in env
                          else cmd, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", **env})


def report(*args: str, **env: str) -> tuple[int, dict[str, Any]]:
    proc = doctor(*args, "--json", **env)
    try:
        return proc.returncode, json.loads(proc.stdout)
    except json.JSONDecodeError as exc:
        raise AssertionError(f"stdout is not JSON:\n{proc.stdout[-2000:]}\n"
                             f"{proc.stderr[-3000:]}") from exc


@pytest.fixture(scope="module")
def tekken_path() -> str:
    from tekken_tokenizer import ensure_tekken_tokenizer

    return str(ensure_tekken_tokenizer())


def test_tiny_model_text_report(tiny_model_path: str) -> None:
    proc = doctor("doctor", tiny_model_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[-1] == "vllm-mmretry doctor: all is well"
    by_name = {line.split()[2]: line for line in lines[:-1]}
    assert set(by_name) == {"vllm", "plugin", "native_core", "settings", "install", "receive",
                            "native_decode", "native_metrics", "catchup_records", "tokenizer",
                            "mm_cache"}
    assert all(line.startswith("[OK  ]") for line in by_name.values()), lines
    assert f"vLLM {installed_vllm_version()} is supported" in by_name["vllm"]
    assert "32001 tokens) runs on the native detokenizer" in by_name["tokenizer"]
    assert "lru with 1 API server(s)" in by_name["mm_cache"]
    assert "drift possible; the plugin recovers from a P1 miss" in by_name["mm_cache"]


def test_tiny_model_json_report_for_two_api_servers(tiny_model_path: str) -> None:
    from vllm_mmretry import __version__

    status, r = report("doctor", tiny_model_path, "--api-server-count", "2")
    assert status == 0 and r["ok"] is True, r
    checks = r["checks"]
    assert checks["vllm"]["details"]["version"] == installed_vllm_version()
    assert checks["plugin"]["details"]["entry_points"] == ["vllm_mmretry:register"]
    assert checks["native_core"]["details"]["core_version"] == __version__
    assert checks["tokenizer"]["status"] == "ok"
    assert checks["tokenizer"]["details"]["reason"] is None
    cache = checks["mm_cache"]["details"]
    assert (cache["cache_type"], cache["api_servers"], cache["drift_possible"]) == (
        "processor_only", 2, False)


@pytest.mark.parametrize(("flags", "cache_type", "drift"), [
    (["--mm-processor-cache-type", "shm"], "shm", False),
    (["--mm-processor-cache-gb", "0"], None, False),
])
def test_tiny_model_other_layouts(tiny_model_path: str, flags: list[str],
                                  cache_type: str | None, drift: bool) -> None:
    status, r = report("doctor", tiny_model_path, *flags)
    assert status == 0, r
    cache = r["checks"]["mm_cache"]["details"]
    assert (cache["cache_type"], cache["drift_possible"]) == (cache_type, drift)


def test_tekken_vocabulary_text_and_json(tekken_path: str) -> None:
    status, r = report("doctor", tekken_path)
    assert status == 0, r
    tok = r["checks"]["tokenizer"]
    assert tok["status"] == "ok" and tok["details"]["vocab_size"] == 131072, tok
    assert r["checks"]["mm_cache"]["status"] == "skip"  # a tokenizer folder, not a model
    proc = doctor("doctor", tekken_path)
    assert proc.returncode == 0
    assert "(131072 tokens) runs on the native detokenizer" in proc.stdout
    assert proc.stdout.splitlines()[-1] == "vllm-mmretry doctor: all is well"


def test_native_detokenizer_switched_off_is_a_warning_with_its_reason(tekken_path: str) -> None:
    status, r = report("doctor", tekken_path, VLLM_MMRETRY_NATIVE_DETOK="0")
    assert status == 0
    assert r["checks"]["tokenizer"]["status"] == "warn"
    assert r["checks"]["tokenizer"]["details"]["reason"] == "disabled"


def test_unsupported_vllm_exits_1() -> None:
    proc = doctor("doctor", "--json", code=FAKE_VERSION)
    assert proc.returncode == 1, proc.stdout + proc.stderr[-3000:]
    r = json.loads(proc.stdout)
    assert r["ok"] is False
    assert r["checks"]["vllm"]["status"] == "fail"
    assert "0.31.9 is not supported" in r["checks"]["vllm"]["summary"]
    text = doctor("doctor", code=FAKE_VERSION)
    assert text.returncode == 1
    assert text.stdout.splitlines()[-1] == "vllm-mmretry doctor: problems found"
    assert text.stdout.startswith("[FAIL] vllm")


def test_vllm_plugins_without_us_exits_1() -> None:
    status, r = report("doctor", VLLM_PLUGINS="some_other_plugin")
    assert status == 1
    assert r["checks"]["plugin"]["status"] == "fail"
    assert "does not list vllm_mmretry" in r["checks"]["plugin"]["summary"]
    status, r = report("doctor", VLLM_PLUGINS="some_other_plugin,vllm_mmretry")
    assert status == 0 and r["checks"]["plugin"]["status"] == "ok"


def test_receive_check_says_when_it_is_off(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_mmretry import doctor, receive

    assert doctor.check_receive().status == "ok"
    monkeypatch.setenv(receive.ENV_SWITCH, "0")
    check = doctor.check_receive()
    assert check.status == "warn" and receive.ENV_SWITCH in check.summary


def test_receive_check_reports_the_native_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_mmretry import doctor, receive

    monkeypatch.setenv(receive.NATIVE_RECEIVE_SWITCH, "1")
    check = doctor.check_receive()
    assert check.status == "ok" and "received by a native thread" in check.summary
    assert "libzmq" in check.summary
    monkeypatch.setattr(receive, "loaded_libzmq", lambda: None)
    check = doctor.check_receive()
    assert check.status == "warn" and "received ready-first" in check.summary


def test_native_decode_check_follows_its_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_mmretry import doctor, receive

    monkeypatch.delenv(receive.DECODE_SWITCH, raising=False)
    check = doctor.check_native_decode()
    assert check.status == "ok" and check.summary.startswith("off")
    monkeypatch.setenv(receive.DECODE_SWITCH, "1")
    check = doctor.check_native_decode()
    assert check.status == "ok" and "decoded natively" in check.summary
    for seam in ("outputs_wire", "receive_seam"):
        monkeypatch.setattr(type(vllm_adapter.get()), seam, lambda self, s=seam: f"a new {s}")
        check = doctor.check_native_decode()
        assert check.status == "warn" and f"a new {seam}" in check.summary


def test_catchup_records_check_follows_its_switch_and_vllms_sources(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_mmretry import catchup, doctor
    from vllm_mmretry.vllm_adapter.output_handler import MERGE_SWITCH

    monkeypatch.delenv(catchup.ENV_SWITCH, raising=False)
    monkeypatch.delenv(MERGE_SWITCH, raising=False)
    check = doctor.check_catchup_records()
    assert check.status == "ok" and "once per catch-up" in check.summary
    assert "reads the messages waiting together" in check.summary
    monkeypatch.setenv(MERGE_SWITCH, "0")
    check = doctor.check_catchup_records()
    assert check.status == "ok" and f"{MERGE_SWITCH}=0" in check.summary
    monkeypatch.delenv(MERGE_SWITCH)
    # A vLLM whose stat logger source is not the one the handler was written against.
    kind = type(vllm_adapter.get())
    monkeypatch.setattr(kind, "HANDLER_DIGESTS", {**kind.HANDLER_DIGESTS, "PrometheusStatLogger.record": "0" * 16})
    check = doctor.check_catchup_records()
    assert check.status == "warn" and "PrometheusStatLogger.record differ" in check.summary
    monkeypatch.setenv(catchup.ENV_SWITCH, "0")
    check = doctor.check_catchup_records()
    assert check.status == "warn" and catchup.ENV_SWITCH in check.summary


def test_native_metrics_check_follows_its_switch_and_self_check(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_mmretry import doctor, prom

    monkeypatch.delenv(prom.ENV_SWITCH, raising=False)
    assert doctor.check_native_metrics().status == "ok"
    monkeypatch.setattr(prom, "self_check", lambda own_methods=None: "expected counter() ok, got ...")
    check = doctor.check_native_metrics()
    assert check.status == "warn" and "expected counter()" in check.summary
    # The multiprocess form alone failing is reported too.
    monkeypatch.setattr(prom, "self_check", lambda own_methods=None: "expected gauge(3,)" if own_methods else None)
    check = doctor.check_native_metrics()
    assert check.status == "warn" and "expected gauge(3,)" in check.summary
    monkeypatch.setenv(prom.ENV_SWITCH, "off")
    check = doctor.check_native_metrics()
    assert check.status == "warn" and prom.ENV_SWITCH in check.summary


def test_plugin_switched_off_claims_nothing_for_it(tiny_model_path: str) -> None:
    """VLLM_MMRETRY=0: nothing the plugin would do is reported as working."""
    proc = doctor("doctor", tiny_model_path, VLLM_MMRETRY="0")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[-1] == "vllm-mmretry doctor: works, with warnings (above)"
    by_name = {line[len("[WARN] "):].split()[0]: line for line in lines[:-1]}
    assert by_name["plugin"].startswith("[WARN]")
    for name in ("receive", "native_decode", "native_metrics", "catchup_records", "tokenizer"):
        assert by_name[name].startswith("[SKIP]") and "the plugin will not run" in by_name[name]
    assert by_name["settings"].startswith("[OK") and "plugin off" in by_name["settings"]
    assert "with the plugin off a P1 miss fails the request" in by_name["mm_cache"]


def test_plugin_switched_off_still_checks_the_fault_switch() -> None:
    """The fault switch applies with the plugin off (tests of stock vLLM use it): a bad
    value stops `vllm serve` there too, and a good one is a warning."""
    status, r = report("doctor", VLLM_MMRETRY="0", VLLM_MMRETRY_FAULTS="p1_miss=bogus")
    assert status == 1 and r["checks"]["settings"]["status"] == "fail"
    status, r = report("doctor", VLLM_MMRETRY="0", VLLM_MMRETRY_FAULTS="p1_miss=every:3",
                       VLLM_MMRETRY_RETRY_BUDGET_RATIO="2")  # the budget is not read when off
    assert status == 0 and r["checks"]["settings"]["status"] == "warn"
    assert "test-only" in r["checks"]["settings"]["summary"]


@pytest.mark.parametrize("name", ["VLLM_MMRETRY_FORCE_SELF_CHECK_FAIL",
                                  "VLLM_MMRETRY_TEST_PANIC_ON_REQUEST"])
def test_test_only_switches_are_warnings(name: str) -> None:
    status, r = report("doctor", **{name: "outputs"})
    assert status == 0 and r["checks"]["settings"]["status"] == "warn"
    assert f"{name}='outputs' is a test-only switch" in r["checks"]["settings"]["summary"]


def test_a_vllm_changed_under_the_plugin_fails_the_install_check(tmp_path: Any) -> None:
    """A vLLM function the adapter calls has another signature (a local patch, another
    plugin: here a `sitecustomize`): `vllm serve` would leave vLLM unpatched, and the
    doctor says so instead of "all is well"."""
    (tmp_path / "sitecustomize.py").write_text(
        "from vllm.v1.engine.output_processor import OutputProcessor\n"
        "def abort_requests(self, request_ids, internal, reason=None): ...\n"
        "OutputProcessor.abort_requests = abort_requests\n")
    status, r = report("doctor", PYTHONPATH=str(tmp_path))
    assert status == 1 and r["checks"]["install"]["status"] == "fail"
    assert ("would leave vLLM unpatched: cannot call OutputProcessor.abort_requests"
            in r["checks"]["install"]["summary"])
    status, r = report("doctor")
    assert status == 0 and r["checks"]["install"]["status"] == "ok"


def test_settings_are_skipped_when_vllm_will_not_load_the_plugin() -> None:
    status, r = report("doctor", VLLM_PLUGINS="someother", VLLM_MMRETRY_FAULTS="p1_miss=bogus")
    assert status == 1 and r["checks"]["plugin"]["status"] == "fail"
    assert r["checks"]["settings"]["status"] == "skip"


def test_doctor_without_vllm_reports_it_without_a_traceback(tmp_path: Any) -> None:
    """An environment with this package and no vLLM (a shadowing empty `vllm` that
    fails to import stands in for it)."""
    fake = tmp_path / "vllm"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('No module named vllm (test)')\n")
    proc = doctor("doctor", PYTHONPATH=str(tmp_path))
    assert proc.returncode == 1, proc.stdout + proc.stderr[-3000:]
    assert "Traceback" not in proc.stdout + proc.stderr
    assert "[FAIL] vllm" in proc.stdout


@pytest.mark.parametrize("env, what", [
    ({"VLLM_MMRETRY_RETRY_BUDGET_RATIO": "2"}, "VLLM_MMRETRY_RETRY_BUDGET_RATIO='2'"),
    ({"VLLM_MMRETRY_METRICS_INTERVAL": "inf"}, "VLLM_MMRETRY_METRICS_INTERVAL='inf'"),
    ({"VLLM_MMRETRY_FAULTS": "p1_miss=bogus"}, "VLLM_MMRETRY_FAULTS='p1_miss=bogus'"),
])
def test_settings_serve_refuses_fail_the_doctor(tiny_model_path: str, env: dict[str, str],
                                                what: str) -> None:
    """`vllm serve` stops at start-up on these: the doctor says so, without a traceback."""
    status, r = report("doctor", **env)
    assert status == 1 and r["checks"]["settings"]["status"] == "fail"
    assert what in r["checks"]["settings"]["summary"]
    proc = doctor("doctor", tiny_model_path, **env)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stdout + proc.stderr
    assert "[FAIL] serve_args" in proc.stdout and what in proc.stdout


def test_fault_injection_is_a_warning() -> None:
    status, r = report("doctor", VLLM_MMRETRY_FAULTS="p1_miss=every:3")
    assert status == 0 and r["checks"]["settings"]["status"] == "warn"
    assert "test-only" in r["checks"]["settings"]["summary"]
    assert r["checks"]["settings"]["details"]["retry_budget"] == {
        "ratio": 0.2, "min_retries": 100, "window_s": 10.0}


def test_the_model_may_be_given_as_a_flag(tiny_model_path: str) -> None:
    """`vllm serve --model M` is as valid as `vllm serve M`; so is `--model=M`."""
    for args in (["--model", tiny_model_path, "--api-server-count", "2"],
                 ["--api-server-count", "2", f"--model={tiny_model_path}"]):
        status, r = report("doctor", *args)
        assert status == 0, r
        assert r["checks"]["tokenizer"]["status"] == "ok"
        cache = r["checks"]["mm_cache"]["details"]
        assert (cache["cache_type"], cache["api_servers"]) == ("processor_only", 2), r


@pytest.mark.usefixtures("only_known_vllm_variables")
def test_the_package_settings_pass_vllms_environment_check(tiny_model_path: str) -> None:
    """With --fail-on-environ-validation vLLM refuses unknown VLLM_* variables; the
    plugin declares its own, so the doctor (like vllm serve) passes."""
    status, r = report("doctor", tiny_model_path, "--fail-on-environ-validation",
                       VLLM_MMRETRY_RETRY_BUDGET_RATIO="0.3")
    assert status == 0 and r["checks"]["mm_cache"]["status"] == "ok", r["checks"]["mm_cache"]
    status, r = report("doctor", tiny_model_path, "--fail-on-environ-validation",
                       VLLM_MMRETRY_RETRY_BUDGT_RATIO="0.3")
    assert status == 1 and "VLLM_MMRETRY_RETRY_BUDGT_RATIO" in r["checks"]["mm_cache"]["summary"]


@pytest.mark.parametrize(("flags", "refusal"), [
    (["--enable-log-outputs"], "--enable-log-outputs requires --enable-log-requests"),
    (["--data-parallel-size", "2", "--data-parallel-multi-port-external-lb",
      "--data-parallel-size-local", "2"], "Non-MoE models do not support external data parallel"),
])
def test_serve_refusals_are_vllms_own(tiny_model_path: str, flags: list[str],
                                      refusal: str) -> None:
    """vLLM's checks of the serve flags and its choice of API servers run as in vllm
    serve (a multi-port supervisor's child is an external-LB rank)."""
    status, r = report("doctor", tiny_model_path, *flags)
    failed = [c["summary"] for c in r["checks"].values() if c["status"] == "fail"]
    assert status == 1 and len(failed) == 1 and refusal in failed[0], r


def test_the_tokenizer_is_loaded_at_the_revision_serve_uses(tiny_model_path: str) -> None:
    status, r = report("doctor", tiny_model_path, "--revision", "v2")
    assert status == 0 and r["checks"]["tokenizer"]["details"]["revision"] == "v2", r
    status, r = report("doctor", tiny_model_path, "--revision", "v2", "--tokenizer-revision", "v3")
    assert status == 0 and r["checks"]["tokenizer"]["details"]["revision"] == "v3", r


def test_vllms_other_front_ends_are_a_warning(tiny_model_path: str) -> None:
    """With vLLM's Rust front end the plugin's API-server parts do not run: the doctor
    does not promise recovery there."""
    status, r = report("doctor", tiny_model_path, VLLM_USE_RUST_FRONTEND="1",
                       VLLM_RUST_FRONTEND_PATH="/bin/false")
    cache = r["checks"]["mm_cache"]
    assert status == 0 and cache["status"] == "warn", cache
    assert cache["details"]["front_end"] == "rust" and "do not run" in cache["summary"]
