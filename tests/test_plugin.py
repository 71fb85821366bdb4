"""The plugin as vLLM loads it: entry point, version gate, VLLM_MMRETRY=0, and the
log lines of a real running server."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
import servers  # tools/, put on sys.path by conftest

from vllm_mmretry import vllm_adapter

PY = sys.executable


def _run(code: str, **env: str) -> dict:
    """Run `code` in a fresh interpreter (patches are per process); it prints JSON."""
    out = subprocess.run(
        [PY, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **env},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


PROBE = """
    import json, vllm_mmretry.vllm_adapter
    {setup}
    from vllm.plugins import load_general_plugins
    load_general_plugins()  # what vLLM does in every process
    from vllm.v1.engine import async_llm, llm_engine, output_processor
    from vllm_mmretry import _patching, plugin
    print(json.dumps({{
        "state": plugin.active_patches(),
        "originals": len(_patching._originals),
        "async_llm_op": async_llm.OutputProcessor.__module__,
        "llm_engine_op": llm_engine.OutputProcessor.__module__,
    }}))
"""


def test_entry_point_is_registered_for_vllm() -> None:
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    assert [ep.value for ep in eps if ep.name == "vllm_mmretry"] == ["vllm_mmretry:register"]


def test_supported_vllm_is_patched_through_the_entry_point() -> None:
    r = _run(PROBE.format(setup=""))
    assert r["originals"] > 0 and r["state"], r
    assert r["async_llm_op"].startswith("vllm_mmretry") and r["llm_engine_op"].startswith("vllm_mmretry")


def test_disabled_leaves_vllm_untouched() -> None:
    r = _run(PROBE.format(setup=""), VLLM_MMRETRY="0")
    assert r == {
        "state": [],
        "originals": 0,
        "async_llm_op": "vllm.v1.engine.output_processor",
        "llm_engine_op": "vllm.v1.engine.output_processor",
    }


@pytest.mark.parametrize(
    "version, supported",
    [
        ("0.32.0", True),
        ("0.33.0", True),
        ("0.34.0", True),
        ("0.31.9", False),
        ("0.32.1", False),
        ("0.33.1", False),
        ("0.34.1", False),
        ("0.35.0", False),
        ("", False),
        (None, False),
    ],
)
def test_version_gate_accepts_exactly_0_32_0_0_33_0_and_0_34_0(version: str | None,
                                                              supported: bool) -> None:
    assert vllm_adapter.is_supported(version) is supported
    assert vllm_adapter.SUPPORTED_VLLM_VERSIONS == {"0.32.0", "0.33.0", "0.34.0"}


@pytest.mark.parametrize("version", ["0.31.9", "0.35.0"])
def test_unsupported_vllm_version_leaves_vllm_untouched(version: str) -> None:
    r = _run(PROBE.format(setup=f"import vllm; vllm.__version__ = '{version}'"))
    assert r == {
        "state": [],
        "originals": 0,
        "async_llm_op": "vllm.v1.engine.output_processor",
        "llm_engine_op": "vllm.v1.engine.output_processor",
    }


@pytest.mark.parametrize("version", ["0.35.0"])
def test_disabled_with_an_unknown_vllm_and_faults_set_still_starts(version: str) -> None:
    """VLLM_MMRETRY=0 must never stop vLLM: on a vLLM the fault switch does not know,
    it is not installed either."""
    r = _run(PROBE.format(setup=f"import vllm; vllm.__version__ = '{version}'"),
             VLLM_MMRETRY="0", VLLM_MMRETRY_FAULTS="p1_miss=every:3")
    assert r["state"] == [] and r["originals"] == 0, r


def test_disabled_with_a_changed_receiver_cache_leaves_the_fault_switch_out() -> None:
    """With the plugin off the fault switch is checked like every patch: a receiver
    cache whose method changed is not patched, and vLLM still starts."""
    r = _run(DRIFT_PROBE.format(setup=(
        "from vllm.multimodal.cache.lru import LruKeyReplicatedReceiverCache as R\n"
        "    def get_and_update_item(self, item, key, extra=None): ...\n"
        "    R.get_and_update_item = get_and_update_item")),
        VLLM_MMRETRY="0", VLLM_MMRETRY_FAULTS="p1_miss=every:3")
    assert r["state"] == [] and r["originals"] == 0, r
    warned = [line for line in r["lines"] if "fault switch is not installed" in line]
    assert len(warned) == 1 and "LruKeyReplicatedReceiverCache.get_and_update_item" in warned[0], r


def test_disabled_with_faults_set_patches_the_receiver_cache_only() -> None:
    r = _run(DRIFT_PROBE.format(setup=""), VLLM_MMRETRY="0",
             VLLM_MMRETRY_FAULTS="p1_miss=every:3")
    assert r["originals"] == 2 and r["op"] == "vllm.v1.engine.output_processor", r
    assert all("[test fault p1_miss=every:3]" in label for label in r["state"]), r


ENVIRON_PROBE = """
    import json
    from vllm import envs
    from vllm.platforms import current_platform
    from vllm.plugins import load_general_plugins
    import os
    load_general_plugins()  # vLLM loads the plugin, then checks the environment
    try:
        current_platform.validate_environ(True)  # --fail-on-environ-validation
        refused = None
    except ValueError as exc:
        refused = str(exc)
    key = envs.compile_factors()
    for name in [n for n in os.environ if n.startswith("VLLM_MMRETRY")]:
        os.environ[name] = "changed"
    same_key = envs.compile_factors() == key
    from vllm_mmretry import plugin
    plugin.uninstall()
    print(json.dumps({{"refused": refused, "same_compile_key": same_key,
                      "left": [n for n in envs.environment_variables if "MMRETRY" in n]}}))
"""


@pytest.mark.parametrize("env", [{"VLLM_MMRETRY_RETRY_BUDGET_RATIO": "0.3"},
                                 {"VLLM_MMRETRY": "0", "VLLM_MMRETRY_FAULTS": "p1_miss=every:3"}])
@pytest.mark.usefixtures("only_known_vllm_variables")
def test_the_package_variables_pass_vllms_environment_check(env: dict[str, str]) -> None:
    """vLLM refuses (or warns about) every VLLM_* variable it does not know: the plugin
    declares its own, on or off; their values stay out of vLLM's torch.compile cache key."""
    r = _run(ENVIRON_PROBE.format(), **env)
    assert r == {"refused": None, "same_compile_key": True, "left": []}, r


def test_with_no_package_variable_set_vllms_compile_cache_key_is_stock() -> None:
    """A declared name enters vLLM's torch.compile cache key: only set ones are declared."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_MMRETRY")}
    out = subprocess.run([PY, "-c", textwrap.dedent("""
        import json
        from vllm import envs
        from vllm.plugins import load_general_plugins
        before = envs.compile_factors()
        load_general_plugins()
        from vllm_mmretry import plugin
        print(json.dumps({"same": envs.compile_factors() == before,
                          "patched": bool(plugin.active_patches())}))
    """)], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"same": True, "patched": True}


@pytest.mark.parametrize("switch", ["0", "1"])
def test_a_vllm_module_that_fails_to_import_never_stops_vllm(switch: str) -> None:
    """register() runs in every vLLM process and vLLM does not catch what it raises."""
    r = _run("""
        import json, sys
        sys.modules["vllm.v1.engine.parallel_sampling"] = None  # an import that fails
        import vllm_mmretry
        print(json.dumps({"state": vllm_mmretry.register()}))
    """, VLLM_MMRETRY=switch)
    assert r == {"state": []}


def test_the_off_switch_imports_no_version_adapter() -> None:
    r = _run("""
        import json, sys
        import vllm_mmretry
        vllm_mmretry.register()
        print(json.dumps({"adapters": [m for m in sys.modules
                                       if m.startswith("vllm_mmretry.vllm_adapter.v0_")]}))
    """, VLLM_MMRETRY="0")
    assert r == {"adapters": []}


@pytest.mark.usefixtures("only_known_vllm_variables")
def test_a_misspelt_package_variable_is_still_refused_by_vllm() -> None:
    r = _run(ENVIRON_PROBE.format(), VLLM_MMRETRY_RETRY_BUDGT_RATIO="0.3")
    assert r["refused"] == "Unknown vLLM environment variable detected: " \
        "VLLM_MMRETRY_RETRY_BUDGT_RATIO", r


# A changed vLLM, as a point release or another plugin could leave it: each must leave
# vLLM wholly unpatched with one WARNING naming what differs, not stop vLLM.
DRIFTS = {
    "entry_gains_a_parameter": (
        "from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat as C\n"
        "async def create_chat_completion(self, request, raw_request=None, *, extra=None): ...\n"
        "C.create_chat_completion = create_chat_completion",
        "cannot patch OpenAIServingChat.create_chat_completion: its signature is "
        "(self, request, raw_request=..., *, extra=...)"),
    "generate_reorders_its_arguments": (
        "from vllm.v1.engine.async_llm import AsyncLLM\n"
        "async def generate(self, sampling_params, prompt, request_id, **kw): yield None\n"
        "AsyncLLM.generate = generate",
        "cannot patch AsyncLLM.generate"),
    "patched_target_is_gone": (
        "from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion as C\n"
        "del C.create_completion",
        "OpenAIServingCompletion"),
    "called_helper_is_renamed": (
        "from vllm.entrypoints.pooling.base.serving import PoolingBaseServing as P\n"
        "P._collect = P._collect_batch\n"
        "del P._collect_batch",
        "installing the adapter failed: AttributeError"),
    "read_field_is_gone": (
        "from vllm.entrypoints.openai.completion.protocol import CompletionRequest as R\n"
        "R.model_fields.pop('use_beam_search')",
        "cannot read CompletionRequest.use_beam_search: not a field of this vLLM's class"),
    "called_helper_changes": (
        "from vllm.v1.engine.output_processor import OutputProcessor as O\n"
        "def abort_requests(self, request_ids, internal, reason=None): ...\n"
        "O.abort_requests = abort_requests",
        "cannot call OutputProcessor.abort_requests: its signature is "
        "(self, request_ids, internal, reason=...)"),
}

DRIFT_PROBE = """
    import json, logging
    {setup}
    from vllm_mmretry import _patching, plugin, vllm_adapter
    from vllm.v1.engine import async_llm
    lines = []
    vllm_adapter.when_vllm_logging_ready = lambda emit: emit()
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("vllm.vllm_mmretry").addHandler(handler)
    state = plugin.register()
    print(json.dumps({{"state": state, "originals": len(_patching._originals),
                      "op": async_llm.OutputProcessor.__module__, "lines": lines}}))
"""


@pytest.mark.parametrize("drift", sorted(DRIFTS))
def test_a_changed_vllm_is_left_wholly_unpatched(drift: str) -> None:
    setup, why = DRIFTS[drift]
    r = _run(DRIFT_PROBE.format(setup=textwrap.indent(setup, "    ").lstrip()))
    assert r["state"] == [] and r["originals"] == 0, r
    assert r["op"] == "vllm.v1.engine.output_processor"
    warned = [line for line in r["lines"] if "vLLM left unpatched" in line]
    assert len(warned) == 1 and why in warned[0], r["lines"]


@pytest.mark.parametrize("env", [{"VLLM_MMRETRY_FAULTS": "p1_miss=bogus"},
                                 {"VLLM_MMRETRY_RETRY_BUDGET_RATIO": "2"},
                                 {"VLLM_MMRETRY_METRICS_INTERVAL": "1,5"}])
def test_a_bad_setting_stops_start_up_even_on_a_changed_vllm(env: dict[str, str]) -> None:
    """The plugin's own settings are read before anything else is compared."""
    setup, _ = DRIFTS["called_helper_changes"]
    r = _run(f"""
        import json
        {textwrap.indent(setup, "        ").lstrip()}
        from vllm_mmretry import _patching, plugin
        try:
            plugin.register()
            raised = None
        except Exception as exc:
            raised = type(exc).__name__
        print(json.dumps({{"raised": raised, "originals": len(_patching._originals)}}))
    """, **env)
    assert r["originals"] == 0
    assert r["raised"] in ("FaultConfigError", "BudgetConfigError", "MetricsConfigError"), r


def test_the_adapters_decode_none_fields_are_fields_of_this_engine_core_output() -> None:
    """The native statistics read `EcoFields.decode_none` by name on every decode
    output: each must be a field of this vLLM's EngineCoreOutput, whose field list the
    adapter's ECO_STRUCT_FIELDS matches exactly."""
    from vllm.v1.engine import EngineCoreOutput

    found = vllm_adapter.get()
    if found is None:
        pytest.skip(f"vLLM {vllm_adapter.installed_vllm_version()} is not supported")
    fields = found.ECO_FIELDS
    assert tuple(EngineCoreOutput.__struct_fields__) == found.ECO_STRUCT_FIELDS
    assert set(fields.decode_none) <= set(found.ECO_STRUCT_FIELDS)
    assert ("watermarking" in fields.decode_none) == ("watermarking" in EngineCoreOutput.__struct_fields__)


def test_the_adapter_records_the_signature_of_every_target_and_called_function() -> None:
    """What `_install_checked` compares: complete for this vLLM, and matching it."""
    r = _run("""
        import json
        from vllm_mmretry import _patching, plugin
        from vllm_mmretry.vllm_adapter import adapter
        state = plugin.register()
        found = adapter()
        labels = [_patching.label(o, n) for o, n in _patching._originals]
        print(json.dumps({"state": len(state), "labels": labels,
                          "called": sorted(found.called_functions()),
                          "recorded": sorted(found.SIGNATURES)}))
    """, VLLM_MMRETRY_FAULTS="p1_miss=every:1", VLLM_MMRETRY_NATIVE_DECODE="1",
        VLLM_MMRETRY_NATIVE_RECEIVE="1")
    assert r["state"] > 0
    assert sorted({*r["labels"], *r["called"]}) == r["recorded"]


def test_uninstall_puts_vllms_configure_logging_back() -> None:
    """Lines that wait for vLLM's logging are dropped by uninstall with the stand-in
    for `configure_logging`; a later register waits with one stand-in, not a chain."""
    r = _run("""
        import json
        import vllm.logger as vlog
        vllm_configure = vlog.configure_logging
        vlog._last_configured_logging_config = None  # as while vLLM's CLI parses
        from vllm_mmretry import plugin
        plugin.register()
        plugin.uninstall()
        restored = vlog.configure_logging is vllm_configure
        plugin.register()
        plugin.uninstall()
        plugin.register()
        stand_in = vlog.configure_logging
        from vllm_mmretry.vllm_adapter import _pending_lines
        print(json.dumps({"restored": restored, "waiting": len(_pending_lines),
                          "one_stand_in": stand_in is not vllm_configure and
                          vlog.configure_logging.__closure__ is not None}))
    """)
    assert r == {"restored": True, "waiting": 1, "one_stand_in": True}


def test_another_plugins_patch_made_after_the_adapter_loaded_still_runs() -> None:
    """RequestOutput.__init__ patched by someone else between the adapter's import and
    our install: ours wraps theirs, and uninstall gives theirs back."""
    r = _run("""
        import functools, json
        from vllm_mmretry.vllm_adapter import adapter
        adapter()  # the version module is imported
        from vllm.outputs import CompletionOutput, RequestOutput
        theirs_init = RequestOutput.__init__

        @functools.wraps(theirs_init)
        def tenant_init(self, *args, **kwargs):
            theirs_init(self, *args, **kwargs)
            self.tenant = "t1"

        RequestOutput.__init__ = tenant_init
        from vllm_mmretry import plugin
        plugin.register()

        def build():
            c = CompletionOutput(index=0, text="", token_ids=[], cumulative_logprob=None,
                                 logprobs=None)
            return RequestOutput(request_id="x", prompt=None, prompt_token_ids=[1],
                                 prompt_logprobs=None, outputs=[c], finished=False)

        o = build()
        plugin.uninstall()
        print(json.dumps({"tenant": getattr(o, "tenant", None), "error": o.error,
                          "theirs_back": RequestOutput.__init__ is tenant_init}))
    """)
    assert r == {"tenant": "t1", "error": None, "theirs_back": True}


def test_register_is_idempotent_and_refuses_double_patching() -> None:
    r = _run("""
        import json, vllm_mmretry
        from vllm_mmretry import _patching, output_processor
        first = vllm_mmretry.register()
        second = vllm_mmretry.register()
        try:
            output_processor.install()
            refused = False
        except _patching.PatchError:
            refused = True
        print(json.dumps({"same": first == second, "n": len(first), "refused": refused}))
    """)
    assert r == {"same": True, "n": r["n"], "refused": True} and r["n"] > 0


@pytest.fixture(scope="module")
def plain_server(tiny_model_path):
    with servers.serve(tiny_model_path) as s:
        yield s


@pytest.mark.e2e  # starts a real server
def test_plugin_active_in_api_server_and_engine_core_of_a_running_server(plain_server) -> None:
    import urllib.request

    with urllib.request.urlopen(plain_server.base_url + "/health") as r:
        assert r.status == 200
    log = plain_server.log()
    # Our line can come before vLLM names the process (the API server logs it as
    # MainProcess, right after logging is configured), so match processes by pid.
    role_of = {pid: role for role, pid in re.findall(r"^\((APIServer|EngineCore)[\w-]* pid=(\d+)\)", log, re.M)}
    active = re.findall(
        r"^\([\w-]+ pid=(\d+)\).*vllm-mmretry active for vLLM [\d.]+ \([^)]*\): patched (.+)$", log, re.M
    )
    pids = [pid for pid, _ in active]
    assert len(pids) == len(set(pids)), "one line per process"
    patched = {role_of[pid]: labels for pid, labels in active if pid in role_of}
    assert set(patched) == {"APIServer", "EngineCore"}, log[-3000:]
    # The API server runs our output processor and the serving retry points.
    for label in ("async_llm.OutputProcessor", "OpenAIServingChat.create_chat_completion"):
        assert label in patched["APIServer"] and label in patched["EngineCore"]
