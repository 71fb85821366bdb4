"""`vllm-mmretry doctor [MODEL_OR_FOLDER] [serve flags...] [--json]`.

Answers, for this environment and the given `vllm serve` arguments: is the installed
vLLM supported; will vLLM load the plugin (entry point, VLLM_PLUGINS, VLLM_MMRETRY);
does the native core match the installed package; will engine outputs be received
ready-first and decoded natively (receive.py); are statistics recorded once
per catch-up of the output handler (catchup.py); does the model's tokenizer run
on the native detokenizer (and if not, why); which multimodal processor cache
layout `vllm serve` would build, and whether P0/P1 drift can happen in it.

Each answer is a check with a status: ok, warn (works, but not at full speed or
not as configured), fail (the plugin will not do its job), skip (not applicable).
The exit status is 1 when any check fails, else 0.

The layout is vLLM's own answer: the serve flags go through vLLM's serve argument
parser and engine arguments into a `VllmConfig`, then through the cache-type
function every cache factory calls (the adapter's `mm_cache_type_lookup`)."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from vllm_mmretry import switches, vllm_adapter
from vllm_mmretry.switches import is_off

OK, WARN, FAIL, SKIP = "ok", "warn", "fail", "skip"
PLUGIN_GROUP = "vllm.general_plugins"
PLUGIN_NAME = "vllm_mmretry"
PLUGIN_VALUE = "vllm_mmretry:register"
DISTRIBUTION = "vllm-mmretry"

# What each cache type means for the processes and for drift (vllm/multimodal/cache/).
LAYOUTS: dict[str | None, tuple[str, bool]] = {
    "lru": ("P0 (API server) keeps a metadata-only LruKeyReplicatedSenderCache, P1 "
            "(engine core) the tensors in an LruKeyReplicatedReceiverCache: the split "
            "that can drift", True),
    "shm": ("the API server writes items into a shared-memory object store "
            "(ShmObjectStoreSenderCache) that the worker reads "
            "(ShmObjectStoreReceiverCache); the sender owns the store", False),
    "processor_only": ("every API server keeps its own MultiModalProcessorOnlyCache and "
                       "items always travel with their data; the engine keeps no "
                       "receiver cache", False),
    None: ("no multimodal processor cache (text-only model or cache disabled)", False),
}


@dataclass
class Check:
    name: str
    status: str
    summary: str
    details: dict[str, Any] = field(default_factory=dict)


# ------------------------------------------------------------------ checks


def check_vllm() -> Check:
    version = vllm_adapter.installed_vllm_version()
    supported = sorted(vllm_adapter.SUPPORTED_VLLM_VERSIONS)
    details = {"version": version, "supported_versions": supported}
    if version is None:
        return Check("vllm", FAIL, "vLLM is not installed", details)
    if not vllm_adapter.is_supported(version):
        return Check("vllm", FAIL, f"vLLM {version} is not supported (supported: "
                     f"{', '.join(supported)}); the plugin leaves it unpatched", details)
    return Check("vllm", OK, f"vLLM {version} is supported", details)


def check_plugin_loading() -> Check:
    eps = [ep for ep in importlib.metadata.entry_points(group=PLUGIN_GROUP)
           if ep.name == PLUGIN_NAME]
    allowed = vllm_adapter.vllm_plugins_setting()
    switch = os.environ.get("VLLM_MMRETRY", "1")
    details: dict[str, Any] = {"entry_points": [ep.value for ep in eps],
                               "VLLM_PLUGINS": allowed, "VLLM_MMRETRY": switch}
    if [ep.value for ep in eps] != [PLUGIN_VALUE]:
        return Check("plugin", FAIL, f"entry point {PLUGIN_GROUP}:{PLUGIN_NAME} -> "
                     f"{PLUGIN_VALUE} not found exactly once (found {details['entry_points']})",
                     details)
    try:
        loaded = eps[0].load()
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        return Check("plugin", FAIL, f"the entry point does not load: {exc!r}", details)
    from vllm_mmretry.plugin import register

    if loaded is not register:
        return Check("plugin", FAIL, "the entry point loads another copy of vllm_mmretry "
                     f"({getattr(loaded, '__module__', loaded)})", details)
    if allowed is not None and PLUGIN_NAME not in allowed:
        return Check("plugin", FAIL, f"VLLM_PLUGINS={','.join(allowed)} does not list "
                     f"{PLUGIN_NAME}: vLLM will not load the plugin", details)
    if is_off(switch):
        return Check("plugin", WARN, f"VLLM_MMRETRY={switch}: the plugin loads but patches "
                     "nothing (but the fault switch, if set)", details)
    return Check("plugin", OK, "vLLM will load the plugin in every process "
                 f"({'all plugins allowed' if allowed is None else 'listed in VLLM_PLUGINS'})",
                 details)


def check_settings(plugin_on: bool = True) -> Check:
    """The plugin's own settings, which `vllm serve` refuses at start-up when invalid
    (the fault switch applies with the plugin off too), and the test-only switches."""
    from vllm_mmretry import budget, faults, metrics

    errors = []
    config = None
    if plugin_on:
        try:
            config = budget.config_from_env()
        except budget.BudgetConfigError as exc:
            errors.append(str(exc))
        try:
            metrics.interval_from_env()
        except metrics.MetricsConfigError as exc:
            errors.append(str(exc))
    try:
        plan = faults.parse(os.environ.get(faults.ENV, ""))
    except faults.FaultConfigError as exc:
        errors.append(str(exc))
    if errors:
        return Check("settings", FAIL, "vllm serve would stop at start-up: " + "; ".join(errors),
                     {"errors": errors})
    test_only = {name: os.environ[name] for name in switches.TEST_ONLY_ENVS if os.environ.get(name)}
    details = {"retry_budget": asdict(config) if config else None,
               "faults": plan.spec if plan else None, "test_only": test_only}
    summary = ("plugin off" if config is None else
               f"retry budget: {config.ratio:g} of requests, at least {config.min_retries} "
               f"retries per {config.window_s:g} s")
    warnings = [f"{faults.ENV}={plan.spec!r}: test-only multimodal cache misses are injected"
                ] if plan is not None else []
    warnings += [f"{name}={value!r} is a test-only switch" for name, value in test_only.items()]
    if warnings:
        return Check("settings", WARN, "; ".join([summary, *warnings]), details)
    return Check("settings", OK, summary, details)


def check_native_core() -> Check:
    from vllm_mmretry import _core

    core = _core.__version__
    try:
        dist: str | None = importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        dist = None
    details = {"core_version": core, "package_version": dist,
               "core_path": getattr(_core, "__file__", None)}
    if dist != core:
        return Check("native_core", FAIL, f"native core {core} does not match the installed "
                     f"package {dist}: a stale build; reinstall or `make setup`", details)
    return Check("native_core", OK, f"native core {core} matches the package", details)


def _adapter_answer(name: str, ask: Callable[[Any], Any], unknown: str) -> Any:
    """The adapter's answer to `ask`, or the check saying there is none (`unknown`
    formatted with the adapter's reason)."""
    found = vllm_adapter.get()
    if found is None:
        return Check(name, SKIP, "needs a supported vLLM")
    answer = ask(found)
    if isinstance(answer, str):
        return Check(name, WARN, unknown.format(answer))
    return answer


def check_install() -> Check:
    """Whether `register()` would patch this vLLM: a dry run of its all-or-nothing
    install (the signature of every vLLM function patched or called), undone after."""
    from vllm_mmretry import _patching, budget, faults, metrics, plugin

    active = plugin.active_patches()
    if active:
        return Check("install", OK, f"patched in this process ({len(active)} patches)")
    try:
        labels = plugin._install_checked()
    except _patching.PatchError as exc:
        return Check("install", FAIL, f"vllm serve would leave vLLM unpatched: {exc}",
                     {"error": str(exc)})
    except (budget.BudgetConfigError, faults.FaultConfigError, metrics.MetricsConfigError):
        return Check("install", SKIP, "the settings above stop vllm serve first")
    plugin.uninstall()
    return Check("install", OK, f"all {len(labels)} patches and the functions the adapter "
                 "calls match this vLLM", {"patches": labels})


def check_receive() -> Check:
    """Whether the API server will receive engine outputs ready-first (receive.py)."""
    from vllm_mmretry import receive

    if not receive.enabled():
        return Check("receive", WARN, f"{receive.ENV_SWITCH}=0: engine outputs are received "
                     "as vLLM does (pyzmq's Future per message; slower under load)")
    seam = _adapter_answer("receive", lambda a: a.receive_seam(), "vLLM's engine-output task is "
                           "not the one the plugin knows ({}): outputs are received as vLLM does")
    if isinstance(seam, Check):
        return seam
    where = f"{seam.owner.__name__}.{seam.method}"
    if receive.native_receive_enabled():
        # The thread calls the libzmq pyzmq loaded; without it the socket stays ready-first.
        libzmq = receive.loaded_libzmq()
        if libzmq is None:
            return Check("receive", WARN, f"{receive.NATIVE_RECEIVE_SWITCH}=1 but no single "
                         "loaded libzmq was found: engine outputs are received ready-first")
        return Check("receive", OK, f"engine outputs are received by a native thread ({where}, "
                     f"{libzmq})")
    return Check("receive", OK, f"engine outputs are received ready-first ({where})")


def check_native_decode() -> Check:
    """Whether engine-output messages are decoded natively (opt-in, receive.py)."""
    from vllm_mmretry import receive

    if not receive.native_decode_enabled():
        # Off is the default and a complete configuration, so it is not a warning.
        return Check("native_decode", OK, f"off, the default ({receive.DECODE_SWITCH}=1 turns it "
                     "on): engine outputs are decoded by vLLM's MsgpackDecoder")
    # The decoder is handed over where the output task starts, then read by the layout.
    for ask, unknown in ((lambda a: a.receive_seam(), "vLLM's engine-output task is not the one "
                          "the plugin knows ({}): vLLM's decoder runs"),
                         (lambda a: a.outputs_wire(), "this vLLM's engine-output messages are not "
                          "the layout the reader knows ({}): vLLM's decoder runs")):
        answer = _adapter_answer("native_decode", ask, unknown)
        if isinstance(answer, Check):
            return answer
    return Check("native_decode", OK, "common engine-output messages are decoded natively, "
                 "the others by vLLM's MsgpackDecoder")


def check_native_metrics() -> Check:
    """Whether vLLM's Prometheus stat loggers get native metric updates (prom.py)."""
    from vllm_mmretry import prom

    if not prom.enabled():
        return Check("native_metrics", WARN, f"{prom.ENV_SWITCH}=0: vLLM's statistics update "
                     "prometheus_client's metrics in Python (slower with statistics on)")
    # Both forms: in-process values, and the file-backed ones of --api-server-count > 1.
    failure = prom.self_check(own_methods=False) or prom.self_check(own_methods=True)
    if failure is not None:
        return Check("native_metrics", WARN, "this prometheus_client's updates differ from the "
                     f"native ones ({failure}): prometheus_client's own methods run")
    return Check("native_metrics", OK, "vLLM's stat loggers update their prometheus metrics "
                 "natively (same samples, checked against prometheus_client, in-process and "
                 "multiprocess)")


def check_catchup_records() -> Check:
    """Whether statistics are recorded once per catch-up of the output handler (catchup.py)."""
    from vllm_mmretry import catchup

    if not catchup.enabled():
        return Check("catchup_records", WARN, f"{catchup.ENV_SWITCH}=0: statistics are recorded "
                     "per engine-output message, as vLLM does (slower with statistics on)")
    seam = _adapter_answer("catchup_records", lambda a: a.output_handler_seam(), "vLLM's output "
                           "handler is not the one the plugin knows ({}): statistics are recorded "
                           "per engine-output message, as vLLM does")
    if isinstance(seam, Check):
        return seam
    from vllm_mmretry.switches import switch_on
    from vllm_mmretry.vllm_adapter.output_handler import MERGE_SWITCH

    merged = ("; in a catch-up the handler reads the messages waiting together" if switch_on(MERGE_SWITCH)
              else f"; {MERGE_SWITCH}=0: the handler reads one waiting message at a time")
    return Check("catchup_records", OK, "statistics are recorded once per catch-up of the output "
                 "handler where the stat loggers are vLLM's defaults (same metrics and log line)" + merged)


def check_tokenizer(target: str | None, args: argparse.Namespace | None) -> Check:
    if target is None or args is None:  # args are vllm serve's, parsed when a target is given
        return Check("tokenizer", SKIP, "no model or folder given")
    from vllm_mmretry.output_processor import NATIVE_DETOK_ENV, native_detok_enabled, native_vocab

    source, options = vllm_adapter.adapter().serve_tokenizer(target, args)
    details: dict[str, Any] = {"tokenizer": source, **options}
    try:
        tokenizer = vllm_adapter.adapter().load_tokenizer(source, options)
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        details["error"] = repr(exc)
        return Check("tokenizer", FAIL, f"vLLM cannot load the tokenizer of {source}: {exc}",
                     details)
    details["class"] = type(tokenizer).__name__
    if not native_detok_enabled():
        details["reason"] = "disabled"
        return Check("tokenizer", WARN, f"{NATIVE_DETOK_ENV}=0: vLLM's Python detokenizer "
                     "runs", details)
    vocab, reason = native_vocab(tokenizer)
    details["reason"] = reason
    if vocab is None:
        return Check("tokenizer", WARN, f"{type(tokenizer).__name__} runs on vLLM's Python "
                     f"detokenizer (reason: {reason}); the output loop is still native", details)
    details["vocab_size"] = tokenizer._tokenizer.get_vocab_size(with_added_tokens=True)
    return Check("tokenizer", OK, f"{type(tokenizer).__name__} "
                 f"({details['vocab_size']} tokens) runs on the native detokenizer", details)


def check_cache_layout(target: str | None, args: argparse.Namespace | None,
                       plugin_on: bool = True) -> Check:
    if target is None or args is None:
        return Check("mm_cache", SKIP, "no model given")
    if os.path.isdir(target) and not os.path.exists(os.path.join(target, "config.json")):
        return Check("mm_cache", SKIP, f"{target} has no config.json (a tokenizer folder, "
                     "not a model)")
    try:
        cache_type, api_servers = _serve_cache_type(args)
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        return Check("mm_cache", FAIL, f"vLLM rejects the model or flags: {exc}",
                     {"error": repr(exc)})
    description, drift = LAYOUTS.get(cache_type, ("unknown cache type", True))
    details = {"cache_type": cache_type, "api_servers": api_servers, "drift_possible": drift,
               "layout": description}
    name = cache_type or "none"
    front_end = vllm_adapter.adapter().serve_front_end(args)
    if front_end is not None:
        details["front_end"] = front_end
        return Check("mm_cache", WARN, f"{name}: vLLM's {front_end} front end serves these "
                     "requests, not its Python API server, so the plugin's retry and native "
                     "output loop do not run for them", details)
    if not drift:
        after = "drift not possible"
    elif plugin_on:
        after = "drift possible; the plugin recovers from a P1 miss"
    else:
        after = "drift possible; with the plugin off a P1 miss fails the request, as in stock vLLM"
    return Check("mm_cache", OK, f"{name} with {api_servers} API server(s): {description}; "
                 f"{after}", details)


# ------------------------------------------------------- vLLM seams
# Everything version-specific is the adapter's (vllm_adapter).


def parse_serve_args(target: str | None, flags: list[str]) -> argparse.Namespace:
    """The namespace `vllm serve TARGET FLAGS...` would run with."""
    argv = ([target] if target else []) + flags
    return vllm_adapter.adapter().parse_serve_args(argv)


def _serve_cache_type(args: argparse.Namespace) -> tuple[str | None, int]:
    api_servers, server_args = vllm_adapter.adapter().serve_api_servers(args)
    return vllm_adapter.adapter().serve_cache_type(server_args, api_servers), api_servers


# ------------------------------------------------------------------ report


# What the plugin would do in a running server: nothing when it is off or not loaded.
PLUGIN_FEATURES: list[Callable[[], Check]] = [
    check_install, check_receive, check_native_decode, check_native_metrics,
    check_catchup_records]


def run_checks(target: str | None, flags: list[str]) -> list[Check]:
    no_vllm = vllm_adapter.installed_vllm_version() is None
    checks = [check_vllm(),
              Check("plugin", SKIP, "needs vLLM") if no_vllm else check_plugin_loading(),
              check_native_core()]
    if checks[0].status == FAIL:
        if target is not None:
            checks.append(Check("tokenizer", SKIP, "needs a supported vLLM"))
            checks.append(Check("mm_cache", SKIP, "needs a supported vLLM"))
        return checks
    plugin_on = checks[1].status == OK
    off = f"the plugin will not run: {checks[1].summary}"
    # Switched off (a WARN), vLLM still calls register(), and the fault switch applies.
    registered = checks[1].status in (OK, WARN)
    checks.append(check_settings(plugin_on) if registered else Check("settings", SKIP, off))
    for feature in PLUGIN_FEATURES:
        checks.append(feature() if plugin_on else Check(feature.__name__[len("check_"):], SKIP, off))
    args = None
    if target is not None:
        if registered:  # as register() does before vllm serve checks the environment
            from vllm_mmretry import plugin

            plugin.declare_environment()
        try:
            args = parse_serve_args(target, flags)
        except SystemExit:
            checks.append(Check("serve_args", FAIL, f"vllm serve rejects the flags {flags}"))
            return checks
        except Exception as exc:  # noqa: BLE001 - e.g. a plugin that refuses its settings
            checks.append(Check("serve_args", FAIL, f"vllm serve fails before it starts: {exc}",
                                {"error": repr(exc)}))
            return checks
    checks.append(check_tokenizer(target, args) if plugin_on or target is None
                  else Check("tokenizer", SKIP, off))
    checks.append(check_cache_layout(target, args, plugin_on))
    return checks


def exit_status(checks: list[Check]) -> int:
    return 1 if any(c.status == FAIL for c in checks) else 0


def render_text(checks: list[Check]) -> str:
    width = max(len(c.name) for c in checks)
    lines = [f"[{c.status.upper():4}] {c.name:<{width}}  {c.summary}" for c in checks]
    if exit_status(checks):
        verdict = "problems found"
    elif any(c.status == WARN for c in checks):
        verdict = "works, with warnings (above)"
    else:
        verdict = "all is well"
    lines.append(f"vllm-mmretry doctor: {verdict}")
    return "\n".join(lines)


def render_json(checks: list[Check]) -> str:
    return json.dumps({"ok": exit_status(checks) == 0,
                       "checks": {c.name: asdict(c) for c in checks}}, indent=2, default=str)


def split_target(argv: list[str]) -> tuple[str | None, list[str]]:
    """The model or folder (first, as `vllm serve MODEL`, or as `--model MODEL`) and
    the other serve flags."""
    if argv and not argv[0].startswith("-"):
        return argv[0], argv[1:]
    for i, arg in enumerate(argv):
        if arg == "--model" and i + 1 < len(argv):
            return argv[i + 1], argv[:i] + argv[i + 2:]
        if arg.startswith("--model="):
            return arg.split("=", 1)[1], argv[:i] + argv[i + 1:]
    return None, argv


def main(argv: list[str]) -> int:
    """`argv`: [MODEL_OR_FOLDER] [serve flags...] [--json]."""
    as_json = "--json" in argv
    rest = [a for a in argv if a != "--json"]
    if rest and rest[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    target, flags = split_target(rest)
    checks = run_checks(target, flags)
    print(render_json(checks) if as_json else render_text(checks))
    sys.stdout.flush()
    return exit_status(checks)
