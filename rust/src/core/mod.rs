//! `OutputCore`: the request table and the per-step loop behind
//! `vllm_mmretry.OutputProcessor`.
//!
//! Each request has a stock vLLM `RequestState` (built in Python at add time, so
//! detokenizer, logprobs processor and stats objects are vLLM's own). Requests on
//! the fast path are driven from Rust: fields of `EngineCoreOutput` are read by
//! offset, output objects are built from pre-filled `__dict__` templates (shared
//! per processor, plus each request's own values) without running Python
//! `__init__`, and outputs go straight into the collector. Requests
//! needing features whose semantics live in vLLM's Python objects (logprobs,
//! pooling, streaming input, routed experts, ...) are handed to an embedded stock
//! `OutputProcessor` (`Mode::Stock`, counted by reason): vLLM's own code steps and
//! aborts them, one batch per run of their outputs; the core routes to it.
//!
//! A fast request detokenizes natively (`Detok::Native`, rust/src/detok.rs) when
//! the processor has a native vocabulary and the request's parameters are
//! supported; otherwise with vLLM's Python detokenizer (`Detok::Python`). The
//! native path never touches the Python `RequestState` per step; when a native
//! request must leave the fast path, its ids are replayed into the stock
//! detokenizer first (`adopt_native`), so vLLM's Python code continues exactly.
//!
//! What the core knows about vLLM comes from the adapter as one typed `CoreSpec`
//! (classes, helpers, FinishReason codes, EngineCoreOutput field names) and one
//! `FastSpec` per request. Files: this one (types and the specs), `step.rs` (the
//! loop), `build.rs` (output objects and their hand-over), `api.rs` (Python API).

use std::collections::BTreeMap;
use std::sync::Arc;

use pyo3::exceptions::{PyKeyError, PyTypeError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyList, PySlice, PyString, PyTuple, PyType};

use crate::detok::py::PyVocab;
use crate::detok::{supports, DetokError, DetokParams, DetokState, StepBuffers, Vocab};
use crate::eco::{Eco, EcoFieldNames, EcoReader, F};
use crate::table::{FxMap, MissSet, Table};

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum OutKind {
    Cumulative,
    Delta,
    FinalOnly,
}

/// Where the incremental detokenization of a fast request happens.
#[allow(clippy::large_enum_variant)] // see `Native`
enum Detok {
    /// vLLM's Python `IncrementalDetokenizer` (or a subclass).
    Python(Py<PyAny>),
    /// The native detokenizer + stop strings. Inline, not boxed: every step of
    /// the request reads it, and a box is one more cold cache line at big batches.
    Native(Native),
}

struct Native {
    st: DetokState,
    /// The output ids as the engine's Python ints, when outputs hand out more
    /// than this step's list: CUMULATIVE gives this same growing list each step
    /// (as stock gives the detokenizer's), stream_interval > 1 slices it.
    ids: Option<Py<PyList>>,
}

fn detok_err(e: DetokError) -> PyErr {
    match e {
        DetokError::Load(m) => PyValueError::new_err(m),
        DetokError::Decode(m) => pyo3::exceptions::PyRuntimeError::new_err(m),
    }
}

/// Runs Rust code so that a bug there (a panic) becomes a Python exception for
/// this call instead of unwinding through the interpreter.
pub(crate) fn guarded<T>(what: &str, f: impl FnOnce() -> T) -> PyResult<T> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).map_err(|p| {
        pyo3::exceptions::PyRuntimeError::new_err(format!(
            "vllm_mmretry core failed in {what}: {}",
            panic_message(p.as_ref())
        ))
    })
}

/// A Python-facing entry point: a panic in it becomes a RuntimeError for this call.
fn api<T>(what: &str, f: impl FnOnce() -> PyResult<T>) -> PyResult<T> {
    guarded(what, f)?
}

/// A request id as the table may hold it; None for a str that is not UTF-8 (a lone
/// surrogate): `add` refuses such an id, so no tracked request has it.
fn tracked_id<'a>(id: &'a Bound<'_, PyString>) -> Option<&'a str> {
    id.to_str().ok()
}

/// Token ids of one step as u32; an id that is no u32 decodes to nothing, as
/// vLLM's `_protected_step` logs and skips it (it still counts as a token).
fn read_ids(ids: &Bound<'_, PyAny>, out: &mut Vec<u32>) -> PyResult<()> {
    out.clear();
    if let Ok(l) = ids.cast::<PyList>() {
        for x in l.iter() {
            out.push(x.extract::<u32>().unwrap_or(u32::MAX));
        }
    } else {
        for x in ids.try_iter()? {
            out.push(x?.extract::<u32>().unwrap_or(u32::MAX));
        }
    }
    Ok(())
}

struct Fast {
    detok: Detok,
    kind: OutKind,
    stream_interval: usize,
    sent_offset: usize,
    /// Output tokens held by the detokenizer (kept here to avoid a Python call).
    n_out: usize,
    ro_template: Template,
    co_template: Template,
    spec_decode_metrics: Option<Py<PyAny>>,
    weight_starts: Vec<(Py<PyAny>, usize)>,
}

#[allow(clippy::large_enum_variant)] // see `Fast`
enum Mode {
    /// Inline, not boxed, for the same reason as `Detok::Native`.
    Fast(Fast),
    /// Owned by the embedded stock processor (vLLM's own code runs it); the core
    /// only routes its outputs and aborts.
    Stock,
}

struct Queue {
    obj: Py<PyAny>,
    /// `obj` is exactly vLLM's RequestOutputCollector: its `put` is inlined
    /// here; otherwise we call `obj.put`.
    exact: bool,
    aggregate: bool,
    /// An exact collector's `__dict__` (`output` and `ready` are plain instance
    /// attributes), and its `ready` event with the event's `__dict__` when that
    /// is exactly `asyncio.Event`: reading and setting them directly skips the
    /// attribute protocol and, when nobody waits, `Event.set`'s Python frame.
    dict: Option<Py<PyDict>>,
    ready: Option<(Py<PyAny>, Py<PyDict>)>,
}

/// What every request's part of one `process_outputs` step shares.
#[derive(Clone, Copy)]
struct Step<'a, 'py> {
    /// `engine_core_timestamp` (None: no stats).
    ts: &'a Bound<'py, PyAny>,
    /// vLLM's `IterationStats` (None when stats are off).
    iteration_stats: &'a Bound<'py, PyAny>,
    weight_version: &'a Bound<'py, PyAny>,
    /// Outputs returned to the caller (LLMEngine mode: no collectors).
    outs: &'a Bound<'py, PyList>,
    /// Internal ids the engine core must abort.
    aborts: &'a Bound<'py, PyList>,
    /// Native statistics for plain decode steps (None: vLLM's function for all).
    decode: Option<&'a stats::DecodeStats<'py>>,
}

struct Req {
    id: Py<PyString>,
    state: Py<PyAny>,
    parent: Option<Py<PyAny>>,
    /// `parent.child_requests` (a set vLLM never rebinds).
    siblings: Option<Py<PyAny>>,
    queue: Option<Queue>,
    lora_name: Py<PyAny>,
    progress: Progress,
    streaming: bool,
    is_pooling: bool,
    mode: Mode,
}

/// What a fast request keeps of its RequestState's progress (written back by
/// `sync_state`); a stock-owned request's stays at its defaults.
struct Progress {
    stats: Py<PyAny>,
    prompt_len: usize,
    is_prefilling: bool,
    num_cached_tokens: Py<PyAny>,
    num_cache_creation_tokens: Py<PyAny>,
    remote_prefill_cached_tokens: Option<Py<PyAny>>,
}

/// Python classes and helper functions the core calls.
struct Classes {
    request_output: Py<PyType>,
    completion_output: Py<PyType>,
    collector: Py<PyType>,
    weight_span: Py<PyType>,
    event: Py<PyType>,
    finish_strs: Vec<Py<PyString>>,
    finish_objs: Vec<Py<PyAny>>,
    finish: FinishCodes,
    fields: OutFields,
    /// Names on vLLM's per-request objects (RequestState, ParentRequest, ...).
    obj: ObjFields,
    /// `RequestOutput.add`'s rules, and whether the native merge may run (the
    /// adapter's self-check passed).
    merge: MergeRules,
    merge_on: bool,
}

/// A struct of vLLM attribute names read from the adapter's spec (by field name),
/// and the same names interned once.
macro_rules! name_table {
    ($(#[$m:meta])* $spec:ident => $interned:ident { $($field:ident),* $(,)? }) => {
        $(#[$m])*
        #[derive(FromPyObject)]
        struct $spec { $($field: String),* }

        struct $interned { $($field: Py<PyString>),* }

        impl $interned {
            fn new(py: Python<'_>, n: &$spec) -> Self {
                Self { $($field: PyString::intern(py, &n.$field).unbind()),* }
            }
        }
    };
}

name_table!(
    /// `vllm_adapter.base.OutputFields`: vLLM's names of the output fields the
    /// fast path fills.
    OutputFieldNames => OutFields {
        outputs,
        finished,
        kv_transfer_params,
        ec_transfer_params,
        num_cached_tokens,
        num_cache_creation_tokens,
        error,
        text,
        token_ids,
        finish_reason,
        stop_reason,
        spec_decode_metrics,
        weight_versions,
    }
);

name_table!(
    /// `vllm_adapter.base.ObjectFields`: vLLM's names of the attributes and methods
    /// of its per-request objects the core reads, writes or calls.
    ObjectFieldNames => ObjFields {
        is_prefilling,
        num_cached_tokens,
        num_cache_creation_tokens,
        prompt_len,
        sent_tokens_offset,
        spec_decode_metrics,
        weight_version_starts,
        remote_prefill_cached_tokens,
        lora_name,
        stats,
        child_requests,
        parent_request_id,
        get_outputs,
        detok_update,
        detok_num_output_tokens,
        detok_output_token_ids,
        detok_get_next_output_text,
        collector_put,
        collector_output,
        collector_ready,
        collector_aggregate,
        output_add,
        request_finished,
        update_from_output,
        mm_processor_cache,
        invalidate,
        stats_num_generation_tokens,
        stats_last_token_ts,
        iteration_num_generation_tokens,
        iteration_inter_token_latencies,
    }
);

/// What the native detokenizer's steps reuse from one request to the next: the
/// step's token ids read from Python and the detokenizer's own buffers.
#[derive(Default)]
struct DetokScratch {
    ids: Vec<u32>,
    detok: StepBuffers,
}

/// The `FinishReason` codes the loop acts on, from the adapter.
#[derive(Clone, Copy)]
struct FinishCodes {
    stop: i64,
    abort: i64,
    error: i64,
}

/// `vllm_adapter.base.CoreSpec`: what the core needs from the running vLLM,
/// read by attribute name.
#[derive(FromPyObject)]
struct CoreSpec<'py> {
    engine_core_output: Bound<'py, PyType>,
    request_output: Bound<'py, PyType>,
    completion_output: Bound<'py, PyType>,
    collector: Bound<'py, PyType>,
    weight_span: Bound<'py, PyType>,
    event: Bound<'py, PyType>,
    finish_reasons: Vec<Bound<'py, PyAny>>,
    finish_stop: i64,
    finish_abort: i64,
    finish_error: i64,
    eco_fields: EcoFieldNames,
    output_fields: OutputFieldNames,
    object_fields: ObjectFieldNames,
    merge_fields: MergeFieldNames,
    helpers: HelperSpec<'py>,
    lora_states: Bound<'py, PyAny>,
    eco_offsets: bool,
}

/// `vllm_adapter.base.CoreHelpers`.
#[derive(FromPyObject)]
struct HelperSpec<'py> {
    stock_step: Bound<'py, PyAny>,
    stock_abort: Bound<'py, PyAny>,
    hand_over: Bound<'py, PyAny>,
    take_back: Bound<'py, PyAny>,
    error_output: Bound<'py, PyAny>,
    finished_stats: Bound<'py, PyAny>,
    adopt_native: Bound<'py, PyAny>,
    failed_output: Bound<'py, PyAny>,
}

/// `vllm_adapter.base.NewRequest`: a request the core starts tracking.
#[derive(FromPyObject)]
struct NewRequest<'py> {
    request_id: Bound<'py, PyString>,
    /// A str, read as UTF-8 in `add` (so a lone surrogate is the UnicodeEncodeError
    /// the request id's would be, not an extraction TypeError).
    external_req_id: Bound<'py, PyString>,
    /// vLLM's `RequestState`.
    state: Bound<'py, PyAny>,
    /// vLLM's `ParentRequest` (n > 1).
    parent: Option<Bound<'py, PyAny>>,
    /// The request's `RequestOutputCollector` (AsyncLLM).
    queue: Option<Bound<'py, PyAny>>,
    /// None: vLLM's per-request step runs it, for `fallback_reason`.
    fast: Option<FastSpec<'py>>,
    fallback_reason: Option<String>,
    /// Streaming input (the request can be resumed).
    streaming: bool,
    is_pooling: bool,
}

/// `vllm_adapter.base.FastSpec`: how one request runs on the fast path.
#[derive(FromPyObject)]
struct FastSpec<'py> {
    detokenizer: Bound<'py, PyAny>,
    native: Option<NativeSpec<'py>>,
    detok_reason: Option<String>,
    output_kind: i64,
    stream_interval: i64,
    num_output_tokens: usize,
    ro_template: Bound<'py, PyDict>,
    co_template: Bound<'py, PyDict>,
    /// The request-independent templates (the same dicts for every request of
    /// the processor), or None: each request copies its own.
    ro_shared: Option<Bound<'py, PyDict>>,
    co_shared: Option<Bound<'py, PyDict>>,
}

/// `vllm_adapter.base.NativeDetokSpec`.
#[derive(FromPyObject)]
struct NativeSpec<'py> {
    prompt_token_ids: Bound<'py, PyAny>,
    skip_special_tokens: bool,
    spaces_between_special_tokens: bool,
    stop: Option<Vec<String>>,
    include_stop_str_in_output: bool,
    min_tokens: usize,
}

fn callable(name: &str, h: Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
    if !h.is_callable() {
        return Err(PyTypeError::new_err(format!(
            "CoreSpec.helpers.{name} must be callable"
        )));
    }
    Ok(h.unbind())
}

struct Helpers {
    /// `stock_step(ecos, ts, stats, weight_version) -> (outputs, aborts, gone ids)`:
    /// the embedded stock processor's `process_outputs` on its requests' outputs.
    stock_step: Py<PyAny>,
    /// `stock_abort(request_id)`: vLLM's abort of a stock-owned request.
    stock_abort: Py<PyAny>,
    /// `hand_over(state)`: a request leaving the fast path joins the stock processor.
    hand_over: Py<PyAny>,
    /// `take_back(request_id)`: the stock processor forgets a request (no output).
    take_back: Py<PyAny>,
    error_output: Py<PyAny>,
    finished_stats: Py<PyAny>,
    /// `adopt_native(state, output_token_ids, last_output_text_offset)`.
    adopt_native: Py<PyAny>,
    /// `failed_output(state, message)`: the terminal error output of a request
    /// whose step panicked.
    failed_output: Py<PyAny>,
}

#[pyclass(module = "vllm_mmretry._core")]
pub struct OutputCore {
    table: Table<Req>,
    parents: FxMap<String, Py<PyAny>>,
    eco: EcoReader,
    cls: Classes,
    helpers: Helpers,
    lora_states: Py<PyAny>,
    mm_cache_source: Option<Py<PyAny>>,
    misses: MissSet,
    fallbacks: BTreeMap<String, u64>,
    fast_steps: u64,
    fallback_steps: u64,
    /// Native decode-step statistics may run (the adapter's self-check passed).
    #[pyo3(get, set)]
    native_stats: bool,
    /// Request-steps whose statistics were recorded natively.
    native_stats_steps: u64,
    /// Outputs merged natively into one their collector still held.
    native_merges: u64,
    invalidations: u64,
    /// The tokenizer, loaded natively once per processor (None: Python detokenizer).
    vocab: Option<Arc<Vocab>>,
    native_requests: u64,
    /// Fast requests detokenized in Python, by reason.
    python_detok: BTreeMap<String, u64>,
    /// Buffers the fast path's detokenizer steps reuse.
    scratch: DetokScratch,
    /// Requests whose step panics on purpose (tests: `TEST_PANIC_ENV`).
    test_panic_on: Vec<String>,
    /// Requests failed by a caught panic in their step.
    failed_steps: u64,
    /// Siblings aborted by a miss or a failure in the current step: the engine
    /// may still have finished one of them in this step (see `step_one`).
    step_sibling_aborts: Vec<String>,
    /// Outputs of stock-owned requests waiting to go to the stock processor as
    /// one batch (flushed before a fast output and at the end of the step, so
    /// outputs keep the engine's order).
    stock_batch: Vec<Py<PyAny>>,
}

/// Tests only: comma-separated request ids whose per-request step panics, read
/// once per processor, to exercise the recovery in `process`.
const TEST_PANIC_ENV: &str = "VLLM_MMRETRY_TEST_PANIC_ON_REQUEST";

fn test_panic_ids() -> Vec<String> {
    std::env::var(TEST_PANIC_ENV)
        .unwrap_or_default()
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
        .collect()
}

/// The message of a caught panic payload.
fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_default()
}

macro_rules! s {
    ($py:expr, $name:literal) => {
        pyo3::intern!($py, $name)
    };
}

/// What an output's `finish_reason` is to the core.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Finish {
    /// None: the request goes on.
    Running,
    /// One of vLLM's `FinishReason` members, by code.
    Member(i64),
    /// Any other value (an int, a str, ...): vLLM's code makes its `str()` the
    /// output's finish reason, so such an output is left to that code.
    Foreign,
}

impl Classes {
    fn finish_of(&self, fr: &Bound<'_, PyAny>) -> Finish {
        if fr.is_none() {
            return Finish::Running;
        }
        // The members are singletons: identity tells a member from an equal int.
        match fr.extract::<i64>() {
            Ok(code)
                if usize::try_from(code)
                    .ok()
                    .and_then(|i| self.finish_objs.get(i))
                    .is_some_and(|m| m.is(fr)) =>
            {
                Finish::Member(code)
            }
            _ => Finish::Foreign,
        }
    }
}

impl Finish {
    /// The member's code (None while running); a foreign value is refused here,
    /// where only members may arrive (the step hands foreign ones to vLLM's code).
    fn code(self, fr: &Bound<'_, PyAny>) -> PyResult<Option<i64>> {
        match self {
            Finish::Running => Ok(None),
            Finish::Member(code) => Ok(Some(code)),
            Finish::Foreign => Err(PyTypeError::new_err(format!(
                "finish_reason must be a FinishReason, got {}",
                fr.get_type()
                    .name()
                    .map(|n| n.to_string())
                    .unwrap_or_default()
            ))),
        }
    }
}

mod ahead;
mod api;
mod build;
mod merge;
mod stats;
mod step;

use build::{Built, StepOut};
use merge::{MergeFieldNames, MergeRules, NextFields, Template};
