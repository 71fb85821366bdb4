"""Statistics recorded once per catch-up of AsyncLLM's output handler.

With statistics on (`vllm serve`'s default), vLLM's output handler builds an
`IterationStats` for every engine-output message and calls its stat loggers' `record`
before it takes the next message. When the engine is ahead of the API server (vLLM's
mock engine always is; a fast engine at high load often), the handler works through
hundreds of waiting messages without yielding to the event loop, and those records
are the largest single item of its per-message work (docs/served-speed.md, "Per
engine-output message"). Nothing else runs on the event loop until the handler has
caught up, so no one can read the metrics in between.

The handler stays vLLM's; the adapter (`vllm_adapter/output_handler.py`) hooks where it
builds and records statistics, so that those of a catch-up are recorded when it ends:
one `record` per engine for the messages' iteration statistics together (Prometheus'
per-iteration token histogram still gets one observation per message), scheduler
statistics per message as in stock. The hooks go in only where the adapter shows that
this leaves the stat loggers what stock leaves: vLLM's default stat loggers and the
vLLM sources they were written against; any other engine's handler is left as it is
(one INFO line says why). VLLM_MMRETRY_CATCHUP_RECORDS=0 leaves every handler alone."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

from vllm_mmretry import _patching
from vllm_mmretry.switches import switch_on
from vllm_mmretry.vllm_adapter import adapter, vllm_logger
from vllm_mmretry.vllm_adapter.base import HandlerSeam

ENV_SWITCH = "VLLM_MMRETRY_CATCHUP_RECORDS"

# engine -> its handler's CatchUp (records, messages), for doctor and tests
_catch_ups: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def enabled() -> bool:
    return switch_on(ENV_SWITCH)


def _log() -> Any:
    return vllm_logger("vllm.vllm_mmretry.catchup")


def install() -> list[str]:
    """Patch the engine's handler starter; [] when off or on an unknown handler."""
    if not enabled():
        return []
    seam = adapter().output_handler_seam()
    if isinstance(seam, str):
        _log().warning("vllm-mmretry: statistics are recorded per engine-output message, as "
                       "vLLM does (%s)", seam)
        return []
    from vllm_mmretry.vllm_adapter.output_handler import install_iteration_stats

    start = getattr(seam.owner, seam.method)
    return [_patching.patch_attr(seam.owner, seam.method, _starting_handler(start, seam)),
            *install_iteration_stats()]


def _starting_handler(start: Callable[[Any], None], seam: HandlerSeam) -> Any:
    """vLLM's handler starter that hooks the handler for catch-up records where it may."""
    @functools.wraps(start)
    def run_output_handler(engine: Any) -> None:
        if seam.started(engine):
            return
        why = seam.why_not(engine)
        if why is not None:
            if why != "statistics are off":  # nothing to record then
                _log().info("vllm-mmretry: statistics are recorded per engine-output message, as "
                            "vLLM does (%s)", why)
            start(engine)
            return
        _catch_ups[engine] = seam.start(engine)

    return run_output_handler


def catch_up_of(engine: Any) -> Any:
    """The engine's handler's `CatchUp` (None: an unhooked handler, or none started yet)."""
    return _catch_ups.get(engine)
