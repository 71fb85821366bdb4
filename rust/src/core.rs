//! `OutputCore`: the request table and the per-step loop behind
//! `vllm_mmretry.OutputProcessor`.
//!
//! Each request has a stock vLLM `RequestState` (built in Python at add time, so
//! detokenizer, logprobs processor and stats objects are vLLM's own). Requests on
//! the fast path are driven from Rust: fields of `EngineCoreOutput` are read by
//! offset, output objects are built from pre-filled `__dict__` templates without
//! running Python `__init__`, and outputs go straight into the collector. Requests
//! needing features whose semantics live in vLLM's Python objects (logprobs,
//! pooling, streaming input, routed experts, ...) run vLLM's own per-request step
//! in Python (`fallback`), counted by reason.
//!
//! A fast request detokenizes natively (`Detok::Native`, rust/src/detok.rs) when
//! the processor has a native vocabulary and the request's parameters are
//! supported; otherwise with vLLM's Python detokenizer (`Detok::Python`). The
//! native path never touches the Python `RequestState` per step; when a native
//! request must leave the fast path, its ids are replayed into the stock
//! detokenizer first (`adopt_native`), so vLLM's Python code continues exactly.

use std::collections::BTreeMap;
use std::sync::Arc;

use pyo3::exceptions::{PyKeyError, PyTypeError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PySlice, PyString, PyTuple, PyType};

use crate::detok::py::PyVocab;
use crate::detok::{supports, DetokError, DetokParams, DetokState, Vocab};
use crate::eco::{Eco, EcoFieldNames, EcoReader, F};
use crate::table::{FxMap, MissSet, Table};

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum OutKind {
    Cumulative,
    Delta,
    FinalOnly,
}

/// Where the incremental detokenization of a fast request happens.
enum Detok {
    /// vLLM's Python `IncrementalDetokenizer` (or a subclass).
    Python(Py<PyAny>),
    /// The native detokenizer + stop strings.
    Native(Box<Native>),
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
fn guarded<T>(what: &str, f: impl FnOnce() -> T) -> PyResult<T> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).map_err(|p| {
        let msg = p.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| p.downcast_ref::<String>().cloned()).unwrap_or_default();
        pyo3::exceptions::PyRuntimeError::new_err(format!("vllm_mmretry core failed in {what}: {msg}"))
    })
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
    ro_template: Py<PyDict>,
    co_template: Py<PyDict>,
    spec_decode_metrics: Option<Py<PyAny>>,
    weight_starts: Vec<(Py<PyAny>, usize)>,
}

enum Mode {
    Fast(Box<Fast>),
    Fallback,
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

struct Req {
    id: Py<PyString>,
    state: Py<PyAny>,
    parent: Option<Py<PyAny>>,
    /// `parent.child_requests` (a set vLLM never rebinds).
    siblings: Option<Py<PyAny>>,
    queue: Option<Queue>,
    lora_name: Py<PyAny>,
    stats: Py<PyAny>,
    prompt_len: usize,
    is_prefilling: bool,
    num_cached_tokens: Py<PyAny>,
    num_cache_creation_tokens: Py<PyAny>,
    remote_prefill_cached_tokens: Option<Py<PyAny>>,
    streaming: bool,
    is_pooling: bool,
    mode: Mode,
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
    helpers: HelperSpec<'py>,
    lora_states: Bound<'py, PyAny>,
    eco_offsets: bool,
}

/// `vllm_adapter.base.CoreHelpers`.
#[derive(FromPyObject)]
struct HelperSpec<'py> {
    fallback_step: Bound<'py, PyAny>,
    abort_output: Bound<'py, PyAny>,
    error_output: Bound<'py, PyAny>,
    finished_stats: Bound<'py, PyAny>,
    adopt_native: Bound<'py, PyAny>,
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
        return Err(PyTypeError::new_err(format!("CoreSpec.helpers.{name} must be callable")));
    }
    Ok(h.unbind())
}

struct Helpers {
    fallback_step: Py<PyAny>,
    abort_output: Py<PyAny>,
    error_output: Py<PyAny>,
    finished_stats: Py<PyAny>,
    /// `adopt_native(state, output_token_ids, last_output_text_offset)`.
    adopt_native: Py<PyAny>,
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
    invalidations: u64,
    /// The tokenizer, loaded natively once per processor (None: Python detokenizer).
    vocab: Option<Arc<Vocab>>,
    native_requests: u64,
    /// Fast requests detokenized in Python, by reason.
    python_detok: BTreeMap<String, u64>,
    ids_buf: Vec<u32>,
}

macro_rules! s {
    ($py:expr, $name:literal) => {
        pyo3::intern!($py, $name)
    };
}

/// A new instance of a plain Python class with `dict` as its `__dict__`,
/// without running `__init__` (the fields are exactly those `__init__` sets).
fn new_with_dict<'py>(cls: &Bound<'py, PyType>, dict: Bound<'py, PyDict>) -> PyResult<Bound<'py, PyAny>> {
    let py = cls.py();
    // SAFETY: GenericNew allocates an instance of a heap type (tp_alloc), and
    // GenericSetDict installs the dict; both return NULL/-1 with an exception set.
    unsafe {
        let args = PyTuple::empty(py);
        let obj = ffi::PyType_GenericNew(cls.as_ptr() as *mut ffi::PyTypeObject, args.as_ptr(), std::ptr::null_mut());
        let obj = Bound::from_owned_ptr_or_err(py, obj)?;
        if ffi::PyObject_GenericSetDict(obj.as_ptr(), dict.as_ptr(), std::ptr::null_mut()) != 0 {
            return Err(PyErr::fetch(py));
        }
        // Stock outputs keep their attributes in the instance (no dict object for
        // the cycle collector). Ours have a dict: untracking it keeps the collector's
        // work per output as stock's (it is a large share of the loop's cost at big
        // batches). Objects it refers to stay tracked and are never freed early; only
        // a reference cycle running through this dict would go uncollected, and
        // CPython re-tracks the dict as soon as a tracked value is stored in it.
        if ffi::PyObject_GC_IsTracked(dict.as_ptr()) != 0 {
            ffi::PyObject_GC_UnTrack(dict.as_ptr().cast());
        }
        Ok(obj)
    }
}

fn copy_dict<'py>(d: &Bound<'py, PyDict>) -> PyResult<Bound<'py, PyDict>> {
    d.copy()
}

fn finish_code(fr: &Bound<'_, PyAny>) -> PyResult<Option<i64>> {
    if fr.is_none() {
        return Ok(None);
    }
    Ok(Some(fr.extract::<i64>().map_err(|_| {
        PyTypeError::new_err(format!("finish_reason must be a FinishReason, got {}", fr.get_type().name().map(|n| n.to_string()).unwrap_or_default()))
    })?))
}

impl OutputCore {
    fn put<'py>(&self, py: Python<'py>, q: &Queue, out: &Bound<'py, PyAny>) -> PyResult<()> {
        let obj = q.obj.bind(py);
        let Some(d) = q.dict.as_ref().filter(|_| q.exact) else {
            obj.call_method1(s!(py, "put"), (out,))?;
            return Ok(());
        };
        // RequestOutputCollector.put, inlined for the RequestOutput case.
        let d = d.bind(py);
        let cur = match d.get_item(s!(py, "output"))? {
            Some(c) => c,
            None => obj.getattr(s!(py, "output"))?,
        };
        if cur.is_none() {
            d.set_item(s!(py, "output"), out)?;
            Self::set_ready(py, q, d)?;
        } else if cur.is_instance(self.cls.request_output.bind(py))? {
            cur.call_method1(s!(py, "add"), (out, q.aggregate))?;
            // The merged output keeps a terminal error even where RequestOutput.add
            // is not patched (install() patches it for other callers).
            let err = out.getattr(s!(py, "error"))?;
            if !err.is_none() {
                cur.setattr(s!(py, "error"), err)?;
            }
        }
        Ok(())
    }

    /// `collector.ready.set()`: with no waiter, `Event.set` only sets `_value`.
    fn set_ready(py: Python<'_>, q: &Queue, d: &Bound<'_, PyDict>) -> PyResult<()> {
        let ready = match d.get_item(s!(py, "ready"))? {
            Some(r) => r,
            None => q.obj.bind(py).getattr(s!(py, "ready"))?,
        };
        if let Some((ev, evd)) = &q.ready {
            if ready.is(ev) {
                let evd = evd.bind(py);
                if let (Some(v), Some(w)) = (evd.get_item(s!(py, "_value"))?, evd.get_item(s!(py, "_waiters"))?) {
                    if v.is_truthy()? {
                        return Ok(());
                    }
                    if w.len()? == 0 {
                        evd.set_item(s!(py, "_value"), true)?;
                        return Ok(());
                    }
                }
            }
        }
        ready.call_method0(s!(py, "set"))?;
        Ok(())
    }

    fn publish<'py>(&self, py: Python<'py>, req: &Req, out: Bound<'py, PyAny>, list: &Bound<'py, PyList>) -> PyResult<()> {
        match &req.queue {
            Some(q) => self.put(py, q, &out),
            None => list.append(out),
        }
    }

    /// Write the Rust-owned mutable fields back into the stock RequestState.
    fn sync_state(py: Python<'_>, req: &Req) -> PyResult<()> {
        let st = req.state.bind(py);
        st.setattr(s!(py, "is_prefilling"), req.is_prefilling)?;
        st.setattr(s!(py, "num_cached_tokens"), req.num_cached_tokens.bind(py))?;
        st.setattr(s!(py, "num_cache_creation_tokens"), req.num_cache_creation_tokens.bind(py))?;
        if let Mode::Fast(f) = &req.mode {
            st.setattr(s!(py, "sent_tokens_offset"), f.sent_offset)?;
            st.setattr(s!(py, "spec_decode_metrics"), f.spec_decode_metrics.as_ref().map(|m| m.bind(py).clone()))?;
            let starts = PyList::empty(py);
            for (v, s) in &f.weight_starts {
                starts.append((v.bind(py), *s))?;
            }
            st.setattr(s!(py, "weight_version_starts"), starts)?;
        }
        Ok(())
    }

    /// Read back the fields a Python helper may have changed.
    fn load_state(py: Python<'_>, req: &mut Req) -> PyResult<()> {
        let st = req.state.bind(py);
        req.is_prefilling = st.getattr(s!(py, "is_prefilling"))?.extract()?;
        req.num_cached_tokens = st.getattr(s!(py, "num_cached_tokens"))?.unbind();
        req.num_cache_creation_tokens = st.getattr(s!(py, "num_cache_creation_tokens"))?.unbind();
        req.prompt_len = st.getattr(s!(py, "prompt_len"))?.extract()?;
        Ok(())
    }

    /// A native detokenizer for a new request, or the reason it cannot have one.
    fn native_detok(
        &self,
        py: Python<'_>,
        vocab: Arc<Vocab>,
        n: NativeSpec<'_>,
        kind: OutKind,
        stream_interval: usize,
    ) -> PyResult<Result<Native, &'static str>> {
        let prompt = n.prompt_token_ids;
        let mut prompt_ids = Vec::with_capacity(prompt.len().unwrap_or(0));
        for x in prompt.try_iter()? {
            match x?.extract::<u32>() {
                Ok(id) => prompt_ids.push(id),
                Err(_) => return Ok(Err("token_id_out_of_range")),
            }
        }
        let params = DetokParams {
            skip_special_tokens: n.skip_special_tokens,
            spaces_between_special_tokens: n.spaces_between_special_tokens,
            stop: n.stop.unwrap_or_default(),
            include_stop_str_in_output: n.include_stop_str_in_output,
            min_tokens: n.min_tokens,
        };
        if let Err(r) = supports(&params) {
            return Ok(Err(r.label()));
        }
        let ids = (kind != OutKind::Delta || stream_interval > 1).then(|| PyList::empty(py).unbind());
        let st = guarded("new", || DetokState::new(vocab, &prompt_ids, params))?;
        Ok(Ok(Native { st, ids }))
    }

    fn demote(&mut self, py: Python<'_>, slot: usize, reason: &str) -> PyResult<()> {
        let req = self.table.get_mut(slot).unwrap();
        Self::sync_state(py, req)?;
        self.helpers.adopt(py, req)?;
        req.mode = Mode::Fallback;
        *self.fallbacks.entry(reason.to_owned()).or_default() += 1;
        Ok(())
    }

}

impl Helpers {
    /// Bring the stock detokenizer of a native request up to date (replaying its
    /// ids), so vLLM's Python code can take over. The request stays as it is.
    fn adopt(&self, py: Python<'_>, req: &Req) -> PyResult<()> {
        if let Mode::Fast(f) = &req.mode {
            if let Detok::Native(nd) = &f.detok {
                let ids = PyList::new(py, nd.st.output_token_ids())?;
                self.adopt_native.bind(py).call1((req.state.bind(py), ids, nd.st.last_output_offset()))?;
            }
        }
        Ok(())
    }
}

impl Classes {
    fn weight_spans<'py>(&self, py: Python<'py>, f: &Fast) -> PyResult<Bound<'py, PyAny>> {
        if f.weight_starts.is_empty() && f.n_out > 0 {
            return Ok(py.None().into_bound(py));
        }
        let spans = PyList::empty(py);
        let cls = self.weight_span.bind(py);
        for (i, (v, start)) in f.weight_starts.iter().enumerate() {
            let end = f.weight_starts.get(i + 1).map(|x| x.1).unwrap_or(f.n_out);
            spans.append(cls.call1((v.bind(py), *start, end))?)?;
        }
        Ok(spans.into_any())
    }

    /// vLLM's `RequestState.make_request_output` for a fast request.
    #[allow(clippy::too_many_arguments)]
    fn make_fast_output<'py>(
        &self,
        py: Python<'py>,
        req: &mut Req,
        new_ids: Bound<'py, PyAny>,
        fr: Option<i64>,
        stop_reason: Bound<'py, PyAny>,
        kv: Bound<'py, PyAny>,
        ec: Bound<'py, PyAny>,
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        let Mode::Fast(f) = &mut req.mode else { unreachable!("fast output for a fallback request") };
        let mut finished = fr.is_some();
        if !finished && f.kind == OutKind::FinalOnly {
            return Ok(None);
        }
        let delta = f.kind == OutKind::Delta;
        let mut token_ids = new_ids;
        if f.stream_interval > 1 {
            if !(finished || f.sent_offset == 0 || f.n_out - f.sent_offset >= f.stream_interval) {
                return Ok(None);
            }
        }
        let (text, all_ids) = match &mut f.detok {
            Detok::Python(detok) => {
                let detok = detok.bind(py);
                let all = if f.stream_interval > 1 || !delta { Some(detok.getattr(s!(py, "output_token_ids"))?) } else { None };
                (detok.call_method1(s!(py, "get_next_output_text"), (finished, delta))?, all)
            }
            Detok::Native(nd) => {
                let st = &mut nd.st;
                let text = guarded("get_next_output_text", || PyString::new(py, st.output_text_ref(finished, delta)).into_any())?;
                (text, nd.ids.as_ref().map(|l| l.bind(py).clone().into_any()))
            }
        };
        if let Some(all) = all_ids {
            if !delta {
                token_ids = all;
            } else if f.stream_interval > 1 {
                token_ids = all.get_item(PySlice::new(py, f.sent_offset as isize, isize::MAX, 1))?;
                f.sent_offset = f.n_out;
            }
        }
        let co = copy_dict(f.co_template.bind(py))?;
        co.set_item(s!(py, "text"), text)?;
        co.set_item(s!(py, "token_ids"), token_ids)?;
        if let Some(code) = fr {
            let fs = self.finish_strs.get(code as usize).ok_or_else(|| PyValueError::new_err(format!("unknown finish_reason {code}")))?;
            co.set_item(s!(py, "finish_reason"), fs.bind(py))?;
            co.set_item(s!(py, "stop_reason"), stop_reason)?;
            if let Some(m) = &f.spec_decode_metrics {
                co.set_item(s!(py, "spec_decode_metrics"), m.bind(py))?;
            }
            co.set_item(s!(py, "weight_versions"), self.weight_spans(py, f)?)?;
        }
        let co = new_with_dict(self.completion_output.bind(py), co)?;
        let outputs = match &req.parent {
            None => PyList::new(py, [co])?.into_any(),
            Some(parent) => {
                if let (None, Some(sib)) = (fr, &req.siblings) {
                    // ParentRequest.get_outputs for an unfinished streamed child (FINAL_ONLY
                    // returned above): this output alone; the parent is finished when no
                    // child is left.
                    finished = sib.bind(py).len()? == 0;
                    PyList::new(py, [co])?.into_any()
                } else {
                    let r = parent.bind(py).call_method1(s!(py, "get_outputs"), (req.id.bind(py), co))?;
                    let (outs, fin): (Bound<'py, PyAny>, bool) = r.extract()?;
                    if !outs.is_truthy()? {
                        return Ok(None);
                    }
                    finished = fin;
                    outs
                }
            }
        };
        // The template holds finished=False, no transfer params and the current
        // cached-token counts (written when prefill ends).
        let ro = copy_dict(f.ro_template.bind(py))?;
        ro.set_item(s!(py, "outputs"), outputs)?;
        if finished {
            ro.set_item(s!(py, "finished"), true)?;
        }
        if !kv.is_none() {
            ro.set_item(s!(py, "kv_transfer_params"), kv)?;
        }
        if !ec.is_none() {
            ro.set_item(s!(py, "ec_transfer_params"), ec)?;
        }
        Ok(Some(new_with_dict(self.request_output.bind(py), ro)?))
    }
}

impl OutputCore {
    /// `_finish_request` + stop-string abort + finished stats.
    #[allow(clippy::too_many_arguments)]
    fn finish<'py>(
        &mut self,
        py: Python<'py>,
        id: &str,
        fr_obj: &Bound<'py, PyAny>,
        engine_finished: bool,
        iteration_stats: &Bound<'py, PyAny>,
        eco: &Bound<'py, PyAny>,
        aborts: &Bound<'py, PyList>,
    ) -> PyResult<()> {
        let Some(req) = self.table.remove(id) else { return Ok(()) };
        if let Some(parent) = &req.parent {
            let p = parent.bind(py);
            if p.getattr(s!(py, "child_requests"))?.len()? == 0 {
                let pid: String = p.getattr(s!(py, "request_id"))?.extract()?;
                self.parents.remove(&pid);
            }
        }
        if !engine_finished {
            aborts.append(req.id.bind(py))?;
        }
        if !iteration_stats.is_none() {
            Self::sync_state(py, &req)?;
            self.helpers.finished_stats.bind(py).call1((
                self.lora_states.bind(py),
                iteration_stats,
                req.state.bind(py),
                fr_obj,
                eco,
            ))?;
        }
        Ok(())
    }

    /// Abort every live sibling of `parent` (n>1 miss): removed here, listed for
    /// the engine core, no abort output (the parent's answer is the error).
    fn abort_siblings<'py>(&mut self, py: Python<'py>, parent: &Bound<'py, PyAny>, aborts: &Bound<'py, PyList>) -> PyResult<()> {
        let children = parent.getattr(s!(py, "child_requests"))?;
        let ids: Vec<String> = PyList::new(py, children.try_iter()?.collect::<PyResult<Vec<_>>>()?)?.extract()?;
        for cid in ids {
            let resolved = self.table.resolve_abort(std::slice::from_ref(&cid), true);
            for rid in resolved {
                if let Some(req) = self.table.pop_aborted(&rid) {
                    self.lora_states.bind(py).call_method1(s!(py, "request_finished"), (req.id.bind(py), req.lora_name.bind(py)))?;
                    aborts.append(req.id.bind(py))?;
                }
            }
        }
        children.call_method0(s!(py, "clear"))?;
        let pid: String = parent.getattr(s!(py, "request_id"))?.extract()?;
        self.parents.remove(&pid);
        Ok(())
    }

    fn invalidate_misses(&mut self, py: Python<'_>) -> PyResult<()> {
        if self.misses.is_empty() {
            return Ok(());
        }
        let cache = match &self.mm_cache_source {
            None => None,
            Some(src) => {
                let src = src.bind(py);
                // Either the cache itself or an object holding it (the renderer),
                // read now because the renderer may rebuild its cache.
                if src.hasattr(s!(py, "invalidate"))? {
                    Some(src.clone())
                } else {
                    let c = src.getattr(s!(py, "mm_processor_cache"))?;
                    (!c.is_none()).then_some(c)
                }
            }
        };
        if let Some(cache) = cache {
            for h in self.misses.hashes() {
                cache.call_method1(s!(py, "invalidate"), (h.as_str(),))?;
                self.invalidations += 1;
            }
        }
        self.misses.clear();
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn step_one<'py>(
        &mut self,
        py: Python<'py>,
        eco: &Bound<'py, PyAny>,
        ts: &Bound<'py, PyAny>,
        iteration_stats: &Bound<'py, PyAny>,
        weight_version: &Bound<'py, PyAny>,
        outs: &Bound<'py, PyList>,
        aborts: &Bound<'py, PyList>,
    ) -> PyResult<()> {
        let ev = self.eco.view(eco);
        let rid_obj = self.eco.get(&ev, F::RequestId)?;
        let rid = rid_obj.cast::<PyString>().map_err(|_| PyTypeError::new_err("EngineCoreOutput.request_id must be a str"))?;
        let rid_s = rid.to_str()?;
        let Some(slot) = self.table.slot_of(rid_s) else {
            return Ok(()); // output for an already-aborted request
        };

        // Per-output features that only vLLM's Python objects implement.
        if matches!(self.table.get(slot).unwrap().mode, Mode::Fast(_)) {
            let reason = if !self.eco.get(&ev, F::RoutedExperts)?.is_none() {
                Some("routed_experts")
            } else if !self.eco.get(&ev, F::NewSamplingMask)?.is_none() {
                Some("sampling_mask")
            } else if !self.eco.get(&ev, F::NewLogprobs)?.is_none()
                || !self.eco.get(&ev, F::NewPromptLogprobsTensors)?.is_none()
                || !self.eco.get(&ev, F::PromptTokenIdLogprobs)?.is_none()
            {
                Some("unrequested_logprobs")
            } else if !self.eco.get(&ev, F::PoolingOutput)?.is_none() {
                Some("pooling_output")
            } else {
                None
            };
            if let Some(r) = reason {
                self.demote(py, slot, r)?;
            }
        }

        let fr_obj = self.eco.get(&ev, F::FinishReason)?;
        let fr = finish_code(&fr_obj)?;
        let miss = fr == Some(self.cls.finish.error) && {
            let m = self.eco.get(&ev, F::MmCacheMissHashes)?;
            !m.is_none() && m.is_truthy()?
        };
        let req = self.table.get(slot).unwrap();
        if miss && !req.is_pooling {
            return self.step_miss(py, slot, eco, ts, iteration_stats, weight_version, outs, aborts, rid_s, &fr_obj);
        }

        match req.mode {
            Mode::Fallback => self.step_fallback(py, slot, eco, ts, iteration_stats, weight_version, outs, aborts, rid_s),
            Mode::Fast(_) => self.step_fast(py, slot, &ev, fr, fr_obj, ts, iteration_stats, weight_version, outs, aborts, rid_s),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn step_fallback<'py>(
        &mut self,
        py: Python<'py>,
        slot: usize,
        eco: &Bound<'py, PyAny>,
        ts: &Bound<'py, PyAny>,
        iteration_stats: &Bound<'py, PyAny>,
        weight_version: &Bound<'py, PyAny>,
        outs: &Bound<'py, PyList>,
        aborts: &Bound<'py, PyList>,
        rid: &str,
    ) -> PyResult<()> {
        self.fallback_steps += 1;
        let req = self.table.get(slot).unwrap();
        let r = self.helpers.fallback_step.bind(py).call1((
            req.state.bind(py),
            eco,
            ts,
            iteration_stats,
            weight_version,
            self.lora_states.bind(py),
        ))?;
        let (out, fr_obj, release): (Bound<'py, PyAny>, Bound<'py, PyAny>, bool) = r.extract()?;
        {
            let req = self.table.get_mut(slot).unwrap();
            Self::load_state(py, req)?;
        }
        let req = self.table.get(slot).unwrap();
        if !out.is_none() {
            self.publish(py, req, out, outs)?;
        }
        if !fr_obj.is_none() && release {
            let engine_finished = !self.eco.get(&self.eco.view(eco), F::FinishReason)?.is_none();
            self.finish(py, rid, &fr_obj, engine_finished, iteration_stats, eco, aborts)?;
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn step_miss<'py>(
        &mut self,
        py: Python<'py>,
        slot: usize,
        eco: &Bound<'py, PyAny>,
        ts: &Bound<'py, PyAny>,
        iteration_stats: &Bound<'py, PyAny>,
        weight_version: &Bound<'py, PyAny>,
        outs: &Bound<'py, PyList>,
        aborts: &Bound<'py, PyList>,
        rid: &str,
        fr_obj: &Bound<'py, PyAny>,
    ) -> PyResult<()> {
        let req = self.table.get(slot).unwrap();
        Self::sync_state(py, req)?;
        self.helpers.adopt(py, req)?;
        // The error output is built by vLLM-aware Python code (rare path); it
        // also runs the iteration-stats update for this output.
        let out = self.helpers.error_output.bind(py).call1((req.state.bind(py), eco, ts, iteration_stats, weight_version, self.lora_states.bind(py)))?;
        let req = self.table.get(slot).unwrap();
        let parent = req.parent.as_ref().map(|p| p.clone_ref(py));
        if let Some(p) = &parent {
            // Take this child out of the parent before aborting its siblings.
            p.bind(py).getattr(s!(py, "child_requests"))?.call_method1(s!(py, "discard"), (rid,))?;
        }
        if let Some(p) = &parent {
            self.abort_siblings(py, p.bind(py), aborts)?;
        }
        let req = self.table.get(slot).unwrap();
        self.publish(py, req, out, outs)?;
        self.finish(py, rid, fr_obj, true, iteration_stats, eco, aborts)?;
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn step_fast<'py>(
        &mut self,
        py: Python<'py>,
        slot: usize,
        ev: &Eco<'_, 'py>,
        mut fr: Option<i64>,
        mut fr_obj: Bound<'py, PyAny>,
        ts: &Bound<'py, PyAny>,
        iteration_stats: &Bound<'py, PyAny>,
        weight_version: &Bound<'py, PyAny>,
        outs: &Bound<'py, PyList>,
        aborts: &Bound<'py, PyList>,
        rid: &str,
    ) -> PyResult<()> {
        self.fast_steps += 1;
        let er = &self.eco;
        let new_ids = er.get(ev, F::NewTokenIds)?;
        let mut stop_reason = er.get(ev, F::StopReason)?;
        let kv = er.get(ev, F::KvTransferParams)?;
        let ec = er.get(ev, F::EcTransferParams)?;
        let spec = er.get(ev, F::SpecDecodeMetrics)?;
        let engine_finished = fr.is_some();
        let prefill_stats = {
            let req = self.table.get(slot).unwrap();
            if req.is_prefilling { Some(er.get(ev, F::PrefillStats)?) } else { None }
        };
        let req = self.table.get_mut(slot).unwrap();

        // 1) Iteration stats, with vLLM's own update function.
        if !iteration_stats.is_none() {
            iteration_stats.call_method1(
                s!(py, "update_from_output"),
                (ev.obj(), ts, req.is_prefilling, req.stats.bind(py), self.lora_states.bind(py), req.lora_name.bind(py)),
            )?;
        }
        if let Some(ps) = prefill_stats {
            if !ps.is_none() {
                req.num_cached_tokens = ps.getattr(s!(py, "num_cached_tokens"))?.unbind();
                req.num_cache_creation_tokens = ps.getattr(s!(py, "num_cache_creation_tokens"))?.unbind();
            }
            if let Some(r) = &req.remote_prefill_cached_tokens {
                req.num_cached_tokens = r.clone_ref(py);
            }
            req.is_prefilling = false;
            if let Mode::Fast(f) = &req.mode {
                let t = f.ro_template.bind(py);
                t.set_item(s!(py, "num_cached_tokens"), req.num_cached_tokens.bind(py))?;
                t.set_item(s!(py, "num_cache_creation_tokens"), req.num_cache_creation_tokens.bind(py))?;
            }
        }
        let Mode::Fast(f) = &mut req.mode else { unreachable!() };
        if !spec.is_none() {
            f.spec_decode_metrics = Some(spec.unbind());
        }
        let n_new = new_ids.len()?;
        if n_new > 0 && !weight_version.is_none() {
            let changed = match f.weight_starts.last() {
                None => true,
                Some((v, _)) => !v.bind(py).eq(weight_version)?,
            };
            if changed {
                f.weight_starts.push((weight_version.clone().unbind(), f.n_out));
            }
        }

        // 2) Detokenize and check stop strings.
        let stop_terminated = fr == Some(self.cls.finish.stop);
        let (stop, n_now): (Option<Bound<'py, PyAny>>, usize) = match &mut f.detok {
            Detok::Python(detok) => {
                let detok = detok.bind(py);
                let stop = detok.call_method1(s!(py, "update"), (&new_ids, stop_terminated))?;
                if stop.is_truthy()? {
                    let n_now: usize = detok.call_method0(s!(py, "num_output_tokens"))?.extract()?;
                    (Some(stop), n_now)
                } else {
                    (None, f.n_out + n_new)
                }
            }
            Detok::Native(nd) => {
                read_ids(&new_ids, &mut self.ids_buf)?;
                let (st, ids) = (&mut nd.st, &self.ids_buf);
                let stop = guarded("update", || st.update(ids, stop_terminated))?.map_err(detok_err)?;
                let n_now = nd.st.num_output_tokens();
                if let Some(l) = &nd.ids {
                    let l = l.bind(py);
                    for x in new_ids.try_iter()? {
                        l.append(x?)?;
                    }
                    if l.len() > n_now {
                        l.del_slice(n_now, l.len())?;
                    }
                }
                (stop.map(|s| PyString::new(py, &s).into_any()), n_now)
            }
        };
        if let Some(stop) = stop {
            fr = Some(self.cls.finish.stop);
            fr_obj = self.cls.finish_objs[self.cls.finish.stop as usize].bind(py).clone();
            stop_reason = stop;
            let kept = n_now.saturating_sub(f.n_out);
            if n_new > kept {
                // Drop tokens past the stop string (vLLM's _trim_surplus_tokens).
                new_ids.del_item(PySlice::new(py, kept as isize, n_new as isize, 1))?;
            }
        }
        f.n_out = n_now;

        // 3) Build and hand over the output.
        let out = {
            let req = self.table.get_mut(slot).unwrap();
            let none = py.None().into_bound(py);
            self.cls.make_fast_output(py, req, new_ids, fr, if fr.is_some() { stop_reason } else { none }, kv, ec)?
        };
        let req = self.table.get(slot).unwrap();
        if let Some(out) = out {
            self.publish(py, req, out, outs)?;
        }
        if fr.is_some() {
            self.finish(py, rid, &fr_obj, engine_finished, iteration_stats, ev.obj(), aborts)?;
        }
        Ok(())
    }

    fn abort_inner<'py>(&mut self, py: Python<'py>, ids: Vec<String>, internal: bool, result: &mut Vec<Py<PyString>>) -> PyResult<()> {
        let resolved = self.table.resolve_abort(&ids, internal);
        for id in resolved {
            if let Some(mut req) = self.table.pop_aborted(&id) {
                self.lora_states.bind(py).call_method1(s!(py, "request_finished"), (req.id.bind(py), req.lora_name.bind(py)))?;
                result.push(req.id.clone_ref(py));
                if req.queue.is_some() {
                    let out = match &req.mode {
                        Mode::Fallback => {
                            let o = self.helpers.abort_output.bind(py).call1((req.state.bind(py),))?;
                            (!o.is_none()).then_some(o)
                        }
                        Mode::Fast(_) => {
                            let none = py.None().into_bound(py);
                            let empty = PyList::empty(py).into_any();
                            self.cls.make_fast_output(py, &mut req, empty, Some(self.cls.finish.abort), none.clone(), none.clone(), none)?
                        }
                    };
                    if let Some(out) = out {
                        let q = req.queue.as_ref().unwrap();
                        self.put(py, q, &out)?;
                    }
                }
            } else if let Some(parent) = self.parents.get(&id).map(|p| p.clone_ref(py)) {
                let children = parent.bind(py).getattr(s!(py, "child_requests"))?;
                let kids: Vec<String> = children.try_iter()?.map(|c| c?.extract::<String>()).collect::<PyResult<_>>()?;
                if !kids.is_empty() {
                    self.abort_inner(py, kids, true, result)?;
                }
                self.parents.remove(&id);
            }
        }
        Ok(())
    }
}

#[pymethods]
impl OutputCore {
    /// `spec`: a `vllm_adapter.base.CoreSpec` built by the adapter of the running vLLM.
    #[new]
    fn new(py: Python<'_>, spec: CoreSpec<'_>) -> PyResult<Self> {
        let finish = FinishCodes { stop: spec.finish_stop, abort: spec.finish_abort, error: spec.finish_error };
        let n_codes = spec.finish_reasons.len() as i64;
        if [finish.stop, finish.abort, finish.error].iter().any(|c| !(0..n_codes).contains(c)) {
            return Err(PyValueError::new_err("CoreSpec: finish codes must index finish_reasons"));
        }
        let mut finish_strs = Vec::new();
        for v in &spec.finish_reasons {
            finish_strs.push(v.str()?.unbind());
        }
        let h = spec.helpers;
        Ok(Self {
            table: Table::default(),
            parents: FxMap::default(),
            eco: EcoReader::new(py, &spec.engine_core_output, &spec.eco_fields, spec.eco_offsets)?,
            cls: Classes {
                request_output: spec.request_output.unbind(),
                completion_output: spec.completion_output.unbind(),
                collector: spec.collector.unbind(),
                weight_span: spec.weight_span.unbind(),
                event: spec.event.unbind(),
                finish_strs,
                finish_objs: spec.finish_reasons.into_iter().map(Bound::unbind).collect(),
                finish,
            },
            helpers: Helpers {
                fallback_step: callable("fallback_step", h.fallback_step)?,
                abort_output: callable("abort_output", h.abort_output)?,
                error_output: callable("error_output", h.error_output)?,
                finished_stats: callable("finished_stats", h.finished_stats)?,
                adopt_native: callable("adopt_native", h.adopt_native)?,
            },
            lora_states: spec.lora_states.unbind(),
            mm_cache_source: None,
            misses: MissSet::default(),
            fallbacks: BTreeMap::new(),
            fast_steps: 0,
            fallback_steps: 0,
            invalidations: 0,
            vocab: None,
            native_requests: 0,
            python_detok: BTreeMap::new(),
            ids_buf: Vec::new(),
        })
    }

    /// True when EngineCoreOutput fields are read by slot offset.
    #[getter]
    fn fast_field_reads(&self) -> bool {
        self.eco.fast()
    }

    /// The native vocabulary fast requests detokenize with (None: vLLM's Python
    /// detokenizer). Applies to requests added afterwards.
    #[setter]
    fn set_native_vocab(&mut self, vocab: Option<Bound<'_, PyVocab>>) {
        self.vocab = vocab.map(|v| v.get().inner.clone());
    }
    #[getter]
    fn get_has_native_vocab(&self) -> bool {
        self.vocab.is_some()
    }

    /// Whether a tracked request detokenizes natively.
    fn is_native(&self, request_id: &str) -> PyResult<bool> {
        let r = self.table.by_id(request_id).ok_or_else(|| PyKeyError::new_err(request_id.to_owned()))?;
        Ok(matches!(&r.mode, Mode::Fast(f) if matches!(f.detok, Detok::Native(_))))
    }

    /// P0's sender cache (has `invalidate`) or an object whose
    /// `mm_processor_cache` attribute holds it (the renderer); None to disable.
    #[setter]
    fn set_mm_cache_source(&mut self, src: Option<Py<PyAny>>) {
        self.mm_cache_source = src;
    }
    #[getter]
    fn get_mm_cache_source(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        self.mm_cache_source.as_ref().map(|s| s.clone_ref(py))
    }

    /// Track a new request. `fast` is a `vllm_adapter.base.FastSpec`
    /// (None: run vLLM's per-request step, `fallback_reason` says why).
    #[pyo3(signature = (request_id, external_req_id, state, parent, queue, fast, fallback_reason, streaming, is_pooling))]
    #[allow(clippy::too_many_arguments)]
    fn add(
        &mut self,
        py: Python<'_>,
        request_id: &Bound<'_, PyString>,
        external_req_id: &str,
        state: &Bound<'_, PyAny>,
        parent: Option<&Bound<'_, PyAny>>,
        queue: Option<&Bound<'_, PyAny>>,
        fast: Option<FastSpec<'_>>,
        fallback_reason: Option<&str>,
        streaming: bool,
        is_pooling: bool,
    ) -> PyResult<()> {
        let id = request_id.to_str()?;
        if self.table.contains(id) {
            return Err(PyValueError::new_err(format!("request {id:?} is already tracked by the output processor")));
        }
        let queue = match queue {
            None => None,
            Some(q) => {
                let exact = q.get_type().is(self.cls.collector.bind(py));
                let dict = if exact { q.getattr("__dict__")?.cast_into::<PyDict>().ok() } else { None };
                let ready = match &dict {
                    Some(_) => {
                        let r = q.getattr("ready")?;
                        if r.get_type().is(self.cls.event.bind(py)) {
                            r.getattr("__dict__")?.cast_into::<PyDict>().ok().map(|d| (r.unbind(), d.unbind()))
                        } else {
                            None
                        }
                    }
                    None => None,
                };
                Some(Queue {
                    obj: q.clone().unbind(),
                    exact,
                    aggregate: if exact { q.getattr("aggregate")?.extract()? } else { false },
                    dict: dict.map(|d| d.unbind()),
                    ready,
                })
            }
        };
        let mode = match fast {
            None => {
                *self.fallbacks.entry(fallback_reason.unwrap_or("unspecified").to_owned()).or_default() += 1;
                Mode::Fallback
            }
            Some(d) => {
                let kind = match d.output_kind {
                    0 => OutKind::Cumulative,
                    1 => OutKind::Delta,
                    2 => OutKind::FinalOnly,
                    k => return Err(PyValueError::new_err(format!("unknown output_kind {k}"))),
                };
                let stream_interval = d.stream_interval.max(1) as usize;
                let has_native = d.native.is_some();
                let detok = match (d.native, &self.vocab) {
                    (Some(n), Some(vocab)) => match self.native_detok(py, vocab.clone(), n, kind, stream_interval)? {
                        Ok(nd) => {
                            self.native_requests += 1;
                            Detok::Native(Box::new(nd))
                        }
                        Err(reason) => {
                            *self.python_detok.entry(reason.to_owned()).or_default() += 1;
                            Detok::Python(d.detokenizer.unbind())
                        }
                    },
                    _ => {
                        let reason = match d.detok_reason {
                            Some(r) => r,
                            None if has_native => "no_native_vocab".to_owned(),
                            None => "unspecified".to_owned(),
                        };
                        *self.python_detok.entry(reason).or_default() += 1;
                        Detok::Python(d.detokenizer.unbind())
                    }
                };
                Mode::Fast(Box::new(Fast {
                    detok,
                    kind,
                    stream_interval,
                    sent_offset: 0,
                    n_out: d.num_output_tokens,
                    ro_template: d.ro_template.unbind(),
                    co_template: d.co_template.unbind(),
                    spec_decode_metrics: None,
                    weight_starts: Vec::new(),
                }))
            }
        };
        let remote: Bound<'_, PyAny> = state.getattr("remote_prefill_cached_tokens")?;
        let req = Req {
            id: request_id.clone().unbind(),
            state: state.clone().unbind(),
            parent: parent.map(|p| p.clone().unbind()),
            siblings: match parent {
                Some(p) => Some(p.getattr("child_requests")?.unbind()),
                None => None,
            },
            queue,
            lora_name: state.getattr("lora_name")?.unbind(),
            stats: state.getattr("stats")?.unbind(),
            prompt_len: state.getattr("prompt_len")?.extract()?,
            is_prefilling: state.getattr("is_prefilling")?.extract()?,
            num_cached_tokens: state.getattr("num_cached_tokens")?.unbind(),
            num_cache_creation_tokens: state.getattr("num_cache_creation_tokens")?.unbind(),
            remote_prefill_cached_tokens: (!remote.is_none()).then(|| remote.unbind()),
            streaming,
            is_pooling,
            mode,
        };
        if let Some(p) = parent {
            let pid: String = p.getattr("request_id")?.extract()?;
            self.parents.insert(pid, p.clone().unbind());
        }
        self.table.insert(id, external_req_id, req).map_err(|e| PyValueError::new_err(e.to_string()))?;
        Ok(())
    }

    /// One step: returns (request_outputs, reqs_to_abort).
    #[pyo3(signature = (engine_core_outputs, engine_core_timestamp=None, iteration_stats=None, weight_version=None))]
    fn process<'py>(
        &mut self,
        py: Python<'py>,
        engine_core_outputs: &Bound<'py, PyAny>,
        engine_core_timestamp: Option<Bound<'py, PyAny>>,
        iteration_stats: Option<Bound<'py, PyAny>>,
        weight_version: Option<Bound<'py, PyAny>>,
    ) -> PyResult<(Bound<'py, PyList>, Bound<'py, PyList>)> {
        // A bug here (a panic) becomes a Python exception, not an unwind through
        // the interpreter.
        guarded("process_outputs", move || -> PyResult<(Bound<'py, PyList>, Bound<'py, PyList>)> {
            let ecos = match engine_core_outputs.cast::<PyList>() {
                Ok(l) => l.clone(),
                Err(_) => PyList::new(py, engine_core_outputs.try_iter().map_err(|_| PyTypeError::new_err("engine_core_outputs must be a list of EngineCoreOutput"))?.collect::<PyResult<Vec<_>>>()?)?,
            };
            let none = py.None().into_bound(py);
            let ts = engine_core_timestamp.unwrap_or_else(|| none.clone());
            let its = iteration_stats.unwrap_or_else(|| none.clone());
            let wv = weight_version.unwrap_or_else(|| none.clone());
            let outs = PyList::empty(py);
            let aborts = PyList::empty(py);

            // Pre-pass: every missing hash of this step is invalidated in P0's sender
            // cache, once, before any output of the step is published.
            let mut with_misses: Vec<Bound<'py, PyAny>> = Vec::new();
            for eco in ecos.iter() {
                let m = self.eco.get(&self.eco.view(&eco), F::MmCacheMissHashes)?;
                if !m.is_none() && m.is_truthy()? {
                    for h in m.try_iter()? {
                        let h = h?;
                        let h = h.cast::<PyString>().map_err(|_| PyTypeError::new_err("mm_cache_miss_hashes must hold str"))?;
                        self.misses.add(h.to_str()?);
                    }
                    with_misses.push(eco);
                }
            }
            self.invalidate_misses(py)?;

            let result = (|| {
                for eco in ecos.iter() {
                    self.step_one(py, &eco, &ts, &its, &wv, &outs, &aborts)?;
                }
                Ok::<(), PyErr>(())
            })();
            // The hashes are consumed: stock AsyncLLM/LLMEngine walk the same outputs
            // after process_outputs and would invalidate them a second time. Clearing
            // the field (instead of patching those loops) keeps that code stock.
            for eco in with_misses {
                eco.setattr(self.eco.name(py, F::MmCacheMissHashes), &none)?;
            }
            result?;
            Ok((outs, aborts))
        })?
    }

    /// vLLM's `abort_requests`: returns the internal ids to abort in the engine.
    fn abort<'py>(&mut self, py: Python<'py>, request_ids: &Bound<'py, PyAny>, internal: bool) -> PyResult<Vec<Py<PyString>>> {
        if request_ids.is_instance_of::<PyString>() {
            return Err(PyTypeError::new_err("request_ids must be an iterable of str, not a str"));
        }
        let ids: Vec<String> = request_ids
            .try_iter()
            .map_err(|_| PyTypeError::new_err("request_ids must be an iterable of str"))?
            .map(|x| x?.extract::<String>().map_err(|_| PyTypeError::new_err("request ids must be str")))
            .collect::<PyResult<_>>()?;
        let mut result = Vec::new();
        self.abort_inner(py, ids, internal, &mut result)?;
        Ok(result)
    }

    /// Drop a finished request (used by streaming-input bookkeeping in Python).
    fn finish_request(&mut self, py: Python<'_>, request_id: &str) -> PyResult<()> {
        let req = self.table.remove(request_id).ok_or_else(|| PyKeyError::new_err(request_id.to_owned()))?;
        if let Some(parent) = &req.parent {
            let p = parent.bind(py);
            if p.getattr("child_requests")?.len()? == 0 {
                let pid: String = p.getattr("request_id")?.extract()?;
                self.parents.remove(&pid);
            }
        }
        Ok(())
    }

    fn has(&self, request_id: &str) -> bool {
        self.table.contains(request_id)
    }
    fn __len__(&self) -> usize {
        self.table.len()
    }
    fn is_streaming(&self, request_id: &str) -> PyResult<bool> {
        self.table.by_id(request_id).map(|r| r.streaming).ok_or_else(|| PyKeyError::new_err(request_id.to_owned()))
    }

    /// The stock RequestState of a request, its fields brought up to date.
    fn state(&self, py: Python<'_>, request_id: &str) -> PyResult<Py<PyAny>> {
        let req = self.table.by_id(request_id).ok_or_else(|| PyKeyError::new_err(request_id.to_owned()))?;
        Self::sync_state(py, req)?;
        Ok(req.state.clone_ref(py))
    }
    /// Read back a state a Python helper changed (streaming updates).
    fn reload_state(&mut self, py: Python<'_>, request_id: &str) -> PyResult<()> {
        let slot = self.table.slot_of(request_id).ok_or_else(|| PyKeyError::new_err(request_id.to_owned()))?;
        Self::load_state(py, self.table.get_mut(slot).unwrap())
    }
    /// {internal id: RequestState}, synced.
    fn states<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for id in self.table.ids() {
            let req = self.table.by_id(id).unwrap();
            Self::sync_state(py, req)?;
            d.set_item(req.id.bind(py), req.state.bind(py))?;
        }
        Ok(d)
    }
    fn parents<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for (k, v) in &self.parents {
            d.set_item(k, v.bind(py))?;
        }
        Ok(d)
    }
    fn external_ids(&self, external_req_id: &str) -> Vec<String> {
        self.table.external_ids(external_req_id).cloned().unwrap_or_default()
    }
    /// Collectors of all live requests (for propagate_error); None for LLMEngine mode.
    fn queues<'py>(&self, py: Python<'py>) -> Vec<Option<Py<PyAny>>> {
        self.table.values().map(|r| r.queue.as_ref().map(|q| q.obj.clone_ref(py))).collect()
    }
    fn num_queued_tokens(&self, py: Python<'_>) -> PyResult<usize> {
        let mut total = 0;
        for r in self.table.values() {
            match r.mode {
                Mode::Fast(_) => {
                    if r.is_prefilling {
                        total += r.prompt_len;
                    }
                }
                Mode::Fallback => {
                    let st = r.state.bind(py);
                    if st.getattr("is_prefilling")?.extract::<bool>()? {
                        total += st.getattr("prompt_len")?.extract::<usize>()?;
                    }
                }
            }
        }
        Ok(total)
    }
    /// {"fast_steps", "fallback_steps", "invalidations", "fallbacks": {reason: n}}.
    fn counters<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        d.set_item("fast_steps", self.fast_steps)?;
        d.set_item("fallback_steps", self.fallback_steps)?;
        d.set_item("invalidations", self.invalidations)?;
        let fb = PyDict::new(py);
        for (k, v) in &self.fallbacks {
            fb.set_item(k, v)?;
        }
        d.set_item("fallbacks", fb)?;
        d.set_item("native_detok", self.native_requests)?;
        let pd = PyDict::new(py);
        for (k, v) in &self.python_detok {
            pd.set_item(k, v)?;
        }
        d.set_item("python_detok", pd)?;
        Ok(d)
    }
    fn is_fast(&self, request_id: &str) -> PyResult<bool> {
        self.table.by_id(request_id).map(|r| matches!(r.mode, Mode::Fast(_))).ok_or_else(|| PyKeyError::new_err(request_id.to_owned()))
    }

    fn __traverse__(&self, visit: pyo3::PyVisit<'_>) -> Result<(), pyo3::PyTraverseError> {
        // Requests hold collectors and states that may point back at us.
        if let Some(s) = &self.mm_cache_source {
            visit.call(s)?;
        }
        visit.call(&self.lora_states)?;
        Ok(())
    }
}

