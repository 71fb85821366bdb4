import weakref
from collections.abc import Callable, Iterable
from typing import Any, final

__all__ = [
    "FastCounterInc",
    "FastGaugeSet",
    "FastHistogramObserve",
    "FastLabels",
    "NativeDetokenizer",
    "NativeVocab",
    "OutputCore",
    "OutputsReader",
    "SocketReceiver",
    "__version__",
    "native_detok_fallback_reason",
]

from vllm_mmretry.vllm_adapter.base import CoreSpec, NewRequest, OutputsWire

__version__: str

# PyO3 classes: built by __new__, not subclassable.
@final
class OutputCore:
    """Request table and per-step loop behind vllm_mmretry.OutputProcessor."""

    fast_field_reads: bool
    mm_cache_source: Any
    # Write-only: the vocabulary requests added afterwards detokenize with (None: Python).
    native_vocab: NativeVocab | None
    has_native_vocab: bool
    # Native decode-step statistics may run (set after the adapter's check_native_stats).
    native_stats: bool
    # Native collector merges may run (set after the adapter's check_native_merge).
    native_merge: bool
    def __new__(cls, spec: CoreSpec) -> OutputCore:
        """`spec`: built by the adapter of the running vLLM (read by field name)."""
    def add(self, request: NewRequest) -> None: ...
    def process(
        self,
        engine_core_outputs: list[Any],
        engine_core_timestamp: float | None = None,
        iteration_stats: Any = None,
        weight_version: str | None = None,
    ) -> tuple[list[Any], list[str]]: ...
    def abort(self, request_ids: Iterable[str], internal: bool) -> list[str]: ...
    def finish_request(self, request_id: str) -> None: ...
    def has(self, request_id: str) -> bool: ...
    def __len__(self) -> int: ...
    def is_streaming(self, request_id: str) -> bool: ...
    def is_fast(self, request_id: str) -> bool: ...
    def native_decode_stats(
        self, eco: Any, ts: Any, req_stats: Any, iteration_stats: Any
    ) -> bool:
        """The native statistics of one plain decode output on the given objects."""
    def native_merge_outputs(self, cur: Any, next: Any) -> bool:
        """The native merge of `next` into `cur` (one completion each), as the loop
        does it: whether it applied (False: left to vLLM's add, nothing written)."""
    def is_native(self, request_id: str) -> bool: ...
    def state(self, request_id: str) -> Any: ...
    def states(self) -> dict[str, Any]: ...
    def parents(self) -> dict[str, Any]: ...
    def external_ids(self, external_req_id: str) -> list[str]: ...
    def queues(self) -> list[Any | None]: ...
    def num_queued_tokens(self) -> int: ...
    def counters(self) -> dict[str, Any]:
        """fast_steps, fallback_steps, invalidations, failed_steps (requests failed by a
        caught panic in their step), fallbacks {reason: n},
        native_detok (requests), python_detok {reason: n} (fast requests)."""

# --- native incremental detokenizer (rust/src/detok.rs) ---------------------------

@final
class NativeVocab:
    """A HF fast tokenizer definition loaded once in Rust; share it between requests."""

    fast_decoder: bool
    def __new__(cls, json: str) -> NativeVocab:
        """From `tokenizer._tokenizer.to_str()` (exactly what vLLM decodes with)."""
    @staticmethod
    def from_file(path: str) -> NativeVocab: ...
    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str: ...
    def self_check(
        self, n_random: int = 2000, max_len: int = 8, seed: int = 0
    ) -> list[tuple[list[int], bool, str, str]]: ...

@final
class NativeDetokenizer:
    """vLLM 0.32's FastIncrementalDetokenizer (+ stop strings), step for step.

    Token ids that are not ints raise TypeError, ints outside 0..2**32-1 ValueError;
    an internal failure is a RuntimeError, after which the detokenizer refuses
    further calls (its state may be half-updated)."""

    output_token_ids: list[int]
    output_text: str
    def __new__(
        cls,
        vocab: NativeVocab,
        prompt_token_ids: Iterable[int] | None,
        *,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ) -> NativeDetokenizer: ...
    def update(self, new_token_ids: Iterable[int], stop_terminated: bool) -> str | None: ...
    def get_next_output_text(self, finished: bool, delta: bool) -> str: ...
    def num_output_tokens(self) -> int: ...

def native_detok_fallback_reason(stop: list[str] | None = None) -> str | None: ...

@final
class OutputsReader:
    """Reads the common engine-output message into vLLM's EngineCoreOutputs (wire.rs)."""

    # The kind given to each EngineCoreOutput field, in declaration order.
    output_kinds: list[str]
    def __new__(cls, schema: OutputsWire) -> OutputsReader: ...
    # None when the message is not of the common shape (vLLM's decoder then reads it).
    def read(self, frame: Any) -> Any | None: ...

@final
class SocketReceiver:
    """A thread reading one libzmq socket off the event loop (recv.rs)."""

    # False once stop() has joined the thread.
    running: bool
    # `socket`: a pyzmq socket (its `underlying` handle), kept alive until stop().
    def __new__(cls, libzmq_path: str, socket: Any) -> SocketReceiver: ...
    # The eventfd that turns readable once a message waits after pop() gave None.
    def fileno(self) -> int: ...
    # A message's frames (bytes, or wrap(bytes)); None when none waits; libzmq's
    # errno when none waits and the thread stopped on that error.
    def pop(self, wrap: Callable[[bytes], Any] | None = None) -> list[Any] | int | None: ...
    def clear_wake(self) -> None: ...
    # (messages taken from the socket, taken and not popped yet)
    def counts(self) -> tuple[int, int]: ...
    # Joins the thread, then closes the eventfd (fileno() is -1 after).
    def stop(self) -> None: ...

# prometheus_client updates for one metric child (prom.rs); any call other than
# the one-positional form goes to the child's own method, which `original`
# (a weakref.WeakMethod) gives. `own_methods`: the values are updated through
# their own inc/set (multiprocess stores), not natively under their lock.
@final
class FastCounterInc:
    def __new__(cls, value: Any, original: Any, *, own_methods: bool = False) -> FastCounterInc: ...
    def __call__(self, *args: Any, **kwargs: Any) -> None: ...

@final
class FastGaugeSet:
    def __new__(
        cls, value: Any, original: Any, *, own_methods: bool = False, clock: Callable[[], float] | None = None
    ) -> FastGaugeSet: ...
    def __call__(self, *args: Any, **kwargs: Any) -> None: ...

@final
class FastHistogramObserve:
    def __new__(
        cls, sum: Any, buckets: list[Any], bounds: list[float], original: Any, *, own_methods: bool = False
    ) -> FastHistogramObserve: ...
    def __call__(self, *args: Any, **kwargs: Any) -> None: ...

# `labels` of a labelled parent: an existing child for str label values, else
# `miss` (the parent's own labels); the parent is held by a weak reference.
@final
class FastLabels:
    def __new__(cls, parent: weakref.ReferenceType[Any], miss: Any) -> FastLabels: ...
    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...
