//! Thin PyO3 view of the native detokenizer (`_core.NativeVocab`,
//! `_core.NativeDetokenizer`), for the Python differential tests and the output loop.

use std::sync::Arc;

use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;

use super::{supports, DetokError, DetokParams, DetokState, Vocab};

fn to_py(e: DetokError) -> PyErr {
    match e {
        DetokError::Load(m) => PyValueError::new_err(m),
        DetokError::Decode(m) => PyRuntimeError::new_err(m),
    }
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
        let vocab = py.detach(|| Vocab::from_json(json)).map_err(to_py)?;
        Ok(PyVocab { inner: Arc::new(vocab) })
    }

    #[staticmethod]
    fn from_file(py: Python<'_>, path: &str) -> PyResult<Self> {
        let vocab = py.detach(|| Vocab::from_file(path)).map_err(to_py)?;
        Ok(PyVocab { inner: Arc::new(vocab) })
    }

    /// Whether decoding uses the per-token table rather than `Tokenizer::decode`.
    #[getter]
    fn fast_decoder(&self) -> bool {
        self.inner.has_fast_decoder()
    }

    #[pyo3(signature = (ids, skip_special_tokens = false))]
    fn decode(&self, ids: Vec<u32>, skip_special_tokens: bool) -> PyResult<String> {
        self.inner.decode(&ids, skip_special_tokens).map_err(to_py)
    }

    /// Table decode vs the tokenizers crate's decode; returns mismatches (empty = ok).
    #[pyo3(signature = (n_random = 2000, max_len = 8, seed = 0))]
    fn self_check(
        &self,
        py: Python<'_>,
        n_random: usize,
        max_len: usize,
        seed: u64,
    ) -> PyResult<Vec<(Vec<u32>, bool, String, String)>> {
        py.detach(|| self.inner.self_check(n_random, max_len, seed)).map_err(to_py)
    }
}

/// One request's incremental detokenizer: vLLM's `FastIncrementalDetokenizer`.
#[pyclass(name = "NativeDetokenizer", module = "vllm_mmretry._core")]
pub struct PyDetok {
    inner: DetokState,
}

#[pymethods]
impl PyDetok {
    #[new]
    #[pyo3(signature = (vocab, prompt_token_ids, *, skip_special_tokens = true,
        spaces_between_special_tokens = true, stop = None,
        include_stop_str_in_output = false, min_tokens = 0))]
    fn new(
        vocab: &PyVocab,
        prompt_token_ids: Option<Vec<u32>>,
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
        let prompt = prompt_token_ids.unwrap_or_default();
        Ok(PyDetok { inner: DetokState::new(vocab.inner.clone(), &prompt, params) })
    }

    /// Returns the matched stop string, if any (output ids/text are truncated).
    fn update(&mut self, new_token_ids: Vec<u32>, stop_terminated: bool) -> PyResult<Option<String>> {
        self.inner.update(&new_token_ids, stop_terminated).map_err(to_py)
    }

    fn get_next_output_text(&mut self, finished: bool, delta: bool) -> String {
        self.inner.output_text(finished, delta)
    }

    fn num_output_tokens(&self) -> usize {
        self.inner.num_output_tokens()
    }

    #[getter]
    fn output_token_ids(&self) -> Vec<u32> {
        self.inner.output_token_ids().to_vec()
    }

    #[getter]
    fn output_text(&self) -> String {
        self.inner.text().to_owned()
    }
}

/// Request-level fallback check: None, or the reason label.
#[pyfunction]
#[pyo3(signature = (stop = None))]
fn native_detok_fallback_reason(stop: Option<Vec<String>>) -> Option<&'static str> {
    let params = DetokParams { stop: stop.unwrap_or_default(), ..Default::default() };
    supports(&params).err().map(|r| r.label())
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyVocab>()?;
    m.add_class::<PyDetok>()?;
    m.add_function(wrap_pyfunction!(native_detok_fallback_reason, m)?)?;
    Ok(())
}
