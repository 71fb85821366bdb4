"""vLLM 0.34: what changed since 0.33 at the package's seams (everything else is
inherited from `v0_33`). See docs/vllm-0.34.md for the reading of both sources.

- `EngineCoreOutput` has a trailing `watermarking: bool | None`. The engine sends
  it once, on a request's first output (the one with `prefill_stats`), when a
  watermark config is set; `IterationStats.update_from_output` copies it into
  `RequestStateStats.is_watermarked`. The native statistics treat an output that
  carries it as not a plain decode step, so vLLM's own `update_from_output` runs
  for it wherever it comes.
- `IterationStats.update_from_output` gained those lines, hence its digest.
- The clients send `EngineCoreRequest.prompt_token_ids` packed as an int32
  ndarray; the output processor still gets the list. Only the engine side (the
  test harness's mock engine) cares.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from vllm_mmretry.vllm_adapter import v0_32, v0_33
from vllm_mmretry.vllm_adapter.base import EcoFields

# EngineCoreOutput's fields in 0.34, in declaration order (slot order).
ECO_STRUCT_FIELDS: tuple[str, ...] = (*v0_33.ECO_STRUCT_FIELDS, "watermarking")
ECO_FIELDS: EcoFields = dataclasses.replace(v0_32.ECO_FIELDS, decode_none=("watermarking",))


class Adapter(v0_33.Adapter):
    """vLLM 0.34.x."""

    version = "0.34.0"
    ECO_STRUCT_FIELDS = ECO_STRUCT_FIELDS
    ECO_FIELDS = ECO_FIELDS
    HANDLER_DIGESTS: ClassVar[dict[str, str]] = {
        **v0_33.Adapter.HANDLER_DIGESTS,
        "IterationStats": "d8653fd863791a6e",
    }
