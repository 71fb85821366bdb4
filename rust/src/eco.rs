//! Fast reads of `EngineCoreOutput` fields.
//!
//! `EngineCoreOutput` is a msgspec `Struct` (gc=False): its fields are object
//! slots at fixed offsets after the object header. At start-up we find each
//! field's offset by building one instance whose fields hold distinct sentinel
//! objects and scanning that instance for the sentinels' addresses. A read is
//! then one pointer load instead of a descriptor lookup (`getattr`). Any object
//! whose type is not exactly the probed class, or a layout we could not map,
//! falls back to `getattr`.

use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyString, PyType};

#[derive(Clone, Copy, Debug)]
#[repr(usize)]
pub enum F {
    RequestId,
    NewTokenIds,
    NewLogprobs,
    NewPromptLogprobsTensors,
    PoolingOutput,
    FinishReason,
    StopReason,
    KvTransferParams,
    EcTransferParams,
    PrefillStats,
    RoutedExperts,
    MmCacheMissHashes,
    NewSamplingMask,
    SpecDecodeMetrics,
    PromptTokenIdLogprobs,
}

pub const NAMES: [&str; 15] = [
    "request_id",
    "new_token_ids",
    "new_logprobs",
    "new_prompt_logprobs_tensors",
    "pooling_output",
    "finish_reason",
    "stop_reason",
    "kv_transfer_params",
    "ec_transfer_params",
    "prefill_stats",
    "routed_experts",
    "mm_cache_miss_hashes",
    "new_sampling_mask",
    "spec_decode_metrics",
    "prompt_token_id_logprobs",
];

pub struct EcoReader {
    cls: Py<PyType>,
    names: Vec<Py<PyString>>,
    /// Byte offsets of each field slot, when the probe found all of them.
    offsets: Option<[isize; NAMES.len()]>,
}

impl EcoReader {
    pub fn new(py: Python<'_>, cls: &Bound<'_, PyType>) -> PyResult<Self> {
        let names = NAMES.iter().map(|n| PyString::intern(py, n).unbind()).collect();
        let offsets = Self::probe(py, cls).unwrap_or(None);
        Ok(Self { cls: cls.clone().unbind(), names, offsets })
    }

    fn probe(py: Python<'_>, cls: &Bound<'_, PyType>) -> PyResult<Option<[isize; NAMES.len()]>> {
        let fields: Vec<String> = cls.getattr("__struct_fields__")?.extract()?;
        let object = py.eval(c"object", None, None)?;
        let kwargs = PyDict::new(py);
        let mut sentinels = Vec::new();
        for f in &fields {
            let s = object.call0()?;
            kwargs.set_item(f, &s)?;
            sentinels.push((f.clone(), s));
        }
        let probe = cls.call((), Some(&kwargs))?;
        let basic: isize = cls.getattr("__basicsize__")?.extract()?;
        let ptr_size = std::mem::size_of::<*mut ffi::PyObject>() as isize;
        let mut offsets = [0isize; NAMES.len()];
        for (i, name) in NAMES.iter().enumerate() {
            let Some((_, s)) = sentinels.iter().find(|(f, _)| f == name) else {
                return Ok(None);
            };
            let want = s.as_ptr();
            let mut found = None;
            let mut off = std::mem::size_of::<ffi::PyObject>() as isize;
            while off + ptr_size <= basic {
                // SAFETY: `probe` is a live instance of `cls` and [0, basicsize) is its
                // fixed-size part; we only compare the loaded word to a pointer.
                let word = unsafe { *(probe.as_ptr() as *const u8).offset(off).cast::<*mut ffi::PyObject>() };
                if word == want {
                    found = Some(off);
                    break;
                }
                off += ptr_size;
            }
            match found {
                Some(o) => offsets[i] = o,
                None => return Ok(None),
            }
            // Double-check through the descriptor.
            if !probe.getattr(*name)?.is(s) {
                return Ok(None);
            }
        }
        Ok(Some(offsets))
    }

    pub fn fast(&self) -> bool {
        self.offsets.is_some()
    }

    pub fn is_exact(&self, obj: &Bound<'_, PyAny>) -> bool {
        // SAFETY: reading the type pointer of a live object.
        unsafe { ffi::Py_TYPE(obj.as_ptr()) == self.cls.as_ptr() as *mut ffi::PyTypeObject }
    }

    /// Field `f` of `eco`. `exact` must be `self.is_exact(eco)`.
    #[inline]
    pub fn get<'py>(&self, eco: &Bound<'py, PyAny>, exact: bool, f: F) -> PyResult<Bound<'py, PyAny>> {
        if exact {
            if let Some(offs) = &self.offsets {
                // SAFETY: `eco` is exactly the probed type, so the slot at this
                // offset holds the field (a strong reference or NULL if unset).
                let p = unsafe { *(eco.as_ptr() as *const u8).offset(offs[f as usize]).cast::<*mut ffi::PyObject>() };
                if !p.is_null() {
                    return Ok(unsafe { Bound::from_borrowed_ptr(eco.py(), p) });
                }
            }
        }
        eco.getattr(self.names[f as usize].bind(eco.py()))
    }

    pub fn name<'py>(&self, py: Python<'py>, f: F) -> &Bound<'py, PyString> {
        self.names[f as usize].bind(py)
    }
}
