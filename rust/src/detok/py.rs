//! Thin PyO3 view of the native detokenizer (`_core.NativeVocab`,
//! `_core.NativeDetokenizer`), for the Python differential tests and the output loop.
//!
//! Every entry point runs its Rust under `guard`: a panic becomes a RuntimeError
//! (never PyO3's PanicException, a BaseException that `except Exception` misses),
//! and bad arguments are TypeError / ValueError.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use pyo3::exceptions::{PyOverflowError, PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyString};

use super::{supports, DetokError, DetokParams, DetokState, StepBuffers, Vocab};

fn to_py(e: DetokError) -> PyErr {
    match e {
        DetokError::Load(m) => PyValueError::new_err(m),
        DetokError::Decode(m) => PyRuntimeError::new_err(m),
    }
}

fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".to_owned())
}

/// Runs `f`; a panic in it is a RuntimeError naming `what`.
pub(crate) fn guard<T>(what: &str, f: impl FnOnce() -> PyResult<T>) -> PyResult<T> {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|p| {
        Err(PyRuntimeError::new_err(format!(
            "vllm_mmretry native detokenizer failed in {what}: {}",
            panic_message(&*p)
        )))
    })
}

/// `self_check`'s answer: (ids, skip_special_tokens, ours, reference) per mismatch.
type Mismatches = Vec<(Vec<u32>, bool, String, String)>;

/// Largest `self_check` workload accepted (it allocates per sequence).
const MAX_SELF_CHECK: usize = 10_000_000;
const MAX_SELF_CHECK_LEN: usize = 100_000;

/// Token ids from any iterable of ints: a non-int is a TypeError, an int outside
/// 0..=u32::MAX a ValueError (PyO3's own extraction would give OverflowError).
fn token_ids(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<u32>> {
    if obj.is_instance_of::<PyString>() || obj.is_instance_of::<PyBytes>() {
        return Err(PyTypeError::new_err(format!(
            "{what} must be a sequence of token ids (ints), not {}",
            obj.get_type().name()?
        )));
    }
    let items = obj.try_iter().map_err(|_| {
        PyTypeError::new_err(format!("{what} must be a sequence of token ids (ints)"))
    })?;
    let mut out = Vec::with_capacity(obj.len().unwrap_or(0));
    for item in items {
        let item = item?;
        match item.extract::<i64>() {
            Ok(v) => out.push(u32::try_from(v).map_err(|_| out_of_range(what, &item))?),
            Err(e) if e.is_instance_of::<PyOverflowError>(obj.py()) => {
                return Err(out_of_range(what, &item))
            }
            Err(_) => {
                return Err(PyTypeError::new_err(format!(
                    "{what} must hold ints, got {}",
                    item.get_type().name()?
                )))
            }
        }
    }
    Ok(out)
}

fn out_of_range(what: &str, item: &Bound<'_, PyAny>) -> PyErr {
    PyValueError::new_err(format!(
        "{what}: token id {item} is outside 0..={}",
        u32::MAX
    ))
}

/// A tokenizer definition loaded once; share it between requests.
#[pyclass(name = "NativeVocab", module = "vllm_mmretry._core", frozen)]
pub struct PyVocab {
    pub inner: Arc<Vocab>,
}

#[pymethods]
impl PyVocab {
    /// From `tokenizer._tokenizer.to_str()` (the exact tokenizer vLLM decodes with).
    #[new]
    fn new(py: Python<'_>, json: &str) -> PyResult<Self> {
        let vocab =
            py.detach(|| guard("NativeVocab()", || Vocab::from_json(json).map_err(to_py)))?;
        Ok(PyVocab {
            inner: Arc::new(vocab),
        })
    }

    #[staticmethod]
    fn from_file(py: Python<'_>, path: &str) -> PyResult<Self> {
        let vocab = py.detach(|| {
            guard("NativeVocab.from_file", || {
                Vocab::from_file(path).map_err(to_py)
            })
        })?;
        Ok(PyVocab {
            inner: Arc::new(vocab),
        })
    }

    /// Whether decoding uses the per-token table rather than `Tokenizer::decode`.
    #[getter]
    fn fast_decoder(&self) -> bool {
        self.inner.has_fast_decoder()
    }

    #[pyo3(signature = (ids, skip_special_tokens = false))]
    fn decode(&self, ids: &Bound<'_, PyAny>, skip_special_tokens: bool) -> PyResult<String> {
        let ids = token_ids(ids, "ids")?;
        guard("NativeVocab.decode", || {
            self.inner.decode(&ids, skip_special_tokens).map_err(to_py)
        })
    }

    /// Table decode vs the tokenizers crate's decode; returns mismatches (empty = ok).
    #[pyo3(signature = (n_random = 2000, max_len = 8, seed = 0))]
    fn self_check(
        &self,
        py: Python<'_>,
        n_random: usize,
        max_len: usize,
        seed: u64,
    ) -> PyResult<Mismatches> {
        if n_random > MAX_SELF_CHECK || max_len > MAX_SELF_CHECK_LEN {
            return Err(PyValueError::new_err(format!(
                "self_check takes n_random <= {MAX_SELF_CHECK} and max_len <= {MAX_SELF_CHECK_LEN}"
            )));
        }
        py.detach(|| {
            guard("NativeVocab.self_check", || {
                self.inner
                    .self_check(n_random, max_len, seed)
                    .map_err(to_py)
            })
        })
    }
}

/// One request's incremental detokenizer: vLLM's `FastIncrementalDetokenizer`.
#[pyclass(name = "NativeDetokenizer", module = "vllm_mmretry._core")]
pub struct PyDetok {
    inner: DetokState,
    bufs: StepBuffers,
    /// Set when a panic cut a call short: the state may be half-updated.
    broken: bool,
}

impl PyDetok {
    /// Runs `f` on the state; a panic breaks this detokenizer for good.
    fn run<T>(
        &mut self,
        what: &str,
        f: impl FnOnce(&mut DetokState, &mut StepBuffers) -> PyResult<T>,
    ) -> PyResult<T> {
        if self.broken {
            return Err(PyRuntimeError::new_err(format!(
                "NativeDetokenizer.{what}: unusable after an earlier internal error"
            )));
        }
        let (inner, bufs) = (&mut self.inner, &mut self.bufs);
        let result = catch_unwind(AssertUnwindSafe(|| f(inner, bufs)));
        result.unwrap_or_else(|p| {
            self.broken = true;
            Err(PyRuntimeError::new_err(format!(
                "vllm_mmretry native detokenizer failed in NativeDetokenizer.{what}: {}",
                panic_message(&*p)
            )))
        })
    }
}

#[pymethods]
impl PyDetok {
    #[new]
    #[pyo3(signature = (vocab, prompt_token_ids, *, skip_special_tokens = true,
        spaces_between_special_tokens = true, stop = None,
        include_stop_str_in_output = false, min_tokens = 0))]
    fn new(
        vocab: &PyVocab,
        prompt_token_ids: Option<&Bound<'_, PyAny>>,
        skip_special_tokens: bool,
        spaces_between_special_tokens: bool,
        stop: Option<Vec<String>>,
        include_stop_str_in_output: bool,
        min_tokens: usize,
    ) -> PyResult<Self> {
        let params = DetokParams {
            skip_special_tokens,
            spaces_between_special_tokens,
            stop: stop.unwrap_or_default(),
            include_stop_str_in_output,
            min_tokens,
        };
        supports(&params).map_err(|r| PyValueError::new_err(r.label()))?;
        let prompt = match prompt_token_ids {
            Some(ids) => token_ids(ids, "prompt_token_ids")?,
            None => Vec::new(),
        };
        let inner = guard("NativeDetokenizer()", || {
            Ok(DetokState::new(vocab.inner.clone(), &prompt, params))
        })?;
        Ok(PyDetok {
            inner,
            bufs: StepBuffers::default(),
            broken: false,
        })
    }

    /// Returns the matched stop string, if any (output ids/text are truncated).
    fn update(
        &mut self,
        new_token_ids: &Bound<'_, PyAny>,
        stop_terminated: bool,
    ) -> PyResult<Option<String>> {
        let ids = token_ids(new_token_ids, "new_token_ids")?;
        self.run("update", |st, bufs| {
            st.update(bufs, &ids, stop_terminated).map_err(to_py)
        })
    }

    fn get_next_output_text(&mut self, finished: bool, delta: bool) -> PyResult<String> {
        self.run("get_next_output_text", |st, _| {
            Ok(st.output_text(finished, delta))
        })
    }

    fn num_output_tokens(&mut self) -> PyResult<usize> {
        self.run("num_output_tokens", |st, _| Ok(st.num_output_tokens()))
    }

    #[getter]
    fn output_token_ids(&mut self) -> PyResult<Vec<u32>> {
        self.run("output_token_ids", |st, _| {
            Ok(st.output_token_ids().to_vec())
        })
    }

    #[getter]
    fn output_text(&mut self) -> PyResult<String> {
        self.run("output_text", |st, _| Ok(st.text().to_owned()))
    }
}

/// Request-level fallback check: None, or the reason label.
#[pyfunction]
#[pyo3(signature = (stop = None))]
fn native_detok_fallback_reason(stop: Option<Vec<String>>) -> PyResult<Option<&'static str>> {
    guard("native_detok_fallback_reason", || {
        let params = DetokParams {
            stop: stop.unwrap_or_default(),
            ..Default::default()
        };
        Ok(supports(&params).err().map(|r| r.label()))
    })
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyVocab>()?;
    m.add_class::<PyDetok>()?;
    m.add_function(wrap_pyfunction!(native_detok_fallback_reason, m)?)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guard_turns_a_panic_into_a_runtime_error() {
        Python::initialize();
        Python::attach(|py| {
            let err = guard("thing", || -> PyResult<()> { panic!("boom {}", 7) }).unwrap_err();
            assert!(err.is_instance_of::<PyRuntimeError>(py));
            assert!(err.to_string().contains("failed in thing: boom 7"), "{err}");
            assert_eq!(guard("thing", || Ok(3)).unwrap(), 3);
        });
    }
}
