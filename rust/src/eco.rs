//! Fast reads of `EngineCoreOutput` fields.
//!
//! `EngineCoreOutput` is a msgspec `Struct` (gc=False): its fields are object
//! slots at fixed offsets after the object header. At start-up we find each
//! field's offset by building one instance whose fields hold distinct sentinel
//! objects and scanning that instance for the sentinels' addresses. A read is
//! then one pointer load instead of a descriptor lookup (`getattr`). Any object
//! whose type is not exactly the probed class, a layout we could not map, or a
//! field list the adapter's self-check rejected, falls back to `getattr`.
//!
//! The fields the core reads are declared once, in `eco_fields!`; their vLLM
//! attribute names come from the adapter (`vllm_adapter.base.EcoFields`).

use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyString, PyType};

macro_rules! eco_fields {
    ($($variant:ident => $field:ident),* $(,)?) => {
        /// A field of `EngineCoreOutput` the core reads.
        #[derive(Clone, Copy, Debug)]
        #[repr(usize)]
        pub enum F { $($variant),* }

        /// How many fields the core reads.
        pub const COUNT: usize = [$(stringify!($field)),*].len();

        /// vLLM's attribute name of each field (`vllm_adapter.base.EcoFields`).
        /// `decode_none`: fields of this vLLM that must be None for the native
        /// plain-decode statistics (a release's new per-request fields).
        #[derive(FromPyObject, Clone, Debug)]
        pub struct EcoFieldNames { $(pub $field: String,)* pub decode_none: Vec<String> }

        impl EcoFieldNames {
            /// The names indexed by `F`.
            pub fn by_field(&self) -> [&str; COUNT] {
                [$(self.$field.as_str()),*]
            }
        }
    };
}

eco_fields! {
    RequestId => request_id,
    NewTokenIds => new_token_ids,
    NewLogprobs => new_logprobs,
    NewPromptLogprobsTensors => new_prompt_logprobs_tensors,
    PoolingOutput => pooling_output,
    FinishReason => finish_reason,
    StopReason => stop_reason,
    KvTransferParams => kv_transfer_params,
    EcTransferParams => ec_transfer_params,
    PrefillStats => prefill_stats,
    RoutedExperts => routed_experts,
    MmCacheMissHashes => mm_cache_miss_hashes,
    NewSamplingMask => new_sampling_mask,
    SpecDecodeMetrics => spec_decode_metrics,
    PromptTokenIdLogprobs => prompt_token_id_logprobs,
    Events => events,
    NumNansInLogits => num_nans_in_logits,
}

type Offsets = [isize; COUNT];

/// Every offset, when each one was found.
fn all_found(found: &[Option<isize>]) -> Option<Vec<isize>> {
    found.iter().copied().collect()
}

pub struct EcoReader {
    cls: Py<PyType>,
    names: Vec<Py<PyString>>,
    /// Byte offsets of each field slot, when the probe found all of them.
    offsets: Option<Offsets>,
    /// `EcoFieldNames::decode_none`, and their slot offsets when probed.
    decode_none: Vec<Py<PyString>>,
    decode_none_offsets: Option<Vec<isize>>,
}

/// An `EngineCoreOutput` seen through a reader: the witness that its type was
/// checked. Only `EcoReader::view` makes one, so slot reads cannot be aimed at
/// an object of another type. (msgspec Structs refuse `__class__` assignment,
/// so the type seen stays the object's type.)
pub struct Eco<'a, 'py> {
    obj: &'a Bound<'py, PyAny>,
    /// The reader's class when `obj`'s type is exactly it, else null.
    exact_for: *const ffi::PyTypeObject,
}

impl<'a, 'py> Eco<'a, 'py> {
    pub fn obj(&self) -> &'a Bound<'py, PyAny> {
        self.obj
    }
}

impl EcoReader {
    /// `slot_reads`: the adapter's self-check accepted the field list; when false
    /// every read is a `getattr`.
    pub fn new(
        py: Python<'_>,
        cls: &Bound<'_, PyType>,
        names: &EcoFieldNames,
        slot_reads: bool,
    ) -> PyResult<Self> {
        let by_field = names.by_field();
        let extra: Vec<&str> = names.decode_none.iter().map(String::as_str).collect();
        // One probe instance for both lists; each list is fast only when all its
        // fields were found.
        let found = if slot_reads {
            let all: Vec<&str> = by_field.iter().chain(&extra).copied().collect();
            Self::probe(py, cls, &all).ok()
        } else {
            None
        };
        let (offsets, decode_none_offsets) = match found {
            Some(found) => {
                let (core, dn) = found.split_at(by_field.len());
                (
                    all_found(core).and_then(|v| Offsets::try_from(v).ok()),
                    all_found(dn),
                )
            }
            None => (None, None),
        };
        let intern = |n: &&str| PyString::intern(py, n).unbind();
        Ok(Self {
            cls: cls.clone().unbind(),
            names: by_field.iter().map(intern).collect(),
            offsets,
            decode_none: extra.iter().map(intern).collect(),
            decode_none_offsets,
        })
    }

    /// Each name's slot offset in `cls` instances, None where it has no slot we
    /// could find and confirm through the descriptor.
    fn probe(
        py: Python<'_>,
        cls: &Bound<'_, PyType>,
        names: &[&str],
    ) -> PyResult<Vec<Option<isize>>> {
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
        let mut offsets = Vec::with_capacity(names.len());
        for name in names {
            let offset = match sentinels.iter().find(|(f, _)| f == name) {
                Some((_, s)) => Self::slot_offset(&probe, basic, s)
                    .filter(|_| probe.getattr(*name).is_ok_and(|v| v.is(s))),
                None => None,
            };
            offsets.push(offset);
        }
        Ok(offsets)
    }

    /// The offset in `probe`'s fixed-size part of the word that points at `want`.
    fn slot_offset(
        probe: &Bound<'_, PyAny>,
        basic: isize,
        want: &Bound<'_, PyAny>,
    ) -> Option<isize> {
        let ptr_size = std::mem::size_of::<*mut ffi::PyObject>() as isize;
        let mut off = std::mem::size_of::<ffi::PyObject>() as isize;
        while off + ptr_size <= basic {
            // SAFETY: `probe` is a live instance of its class and [0, basicsize) is its
            // fixed-size part; we only compare the loaded word to a pointer.
            let word = unsafe {
                *(probe.as_ptr() as *const u8)
                    .offset(off)
                    .cast::<*mut ffi::PyObject>()
            };
            if word == want.as_ptr() {
                return Some(off);
            }
            off += ptr_size;
        }
        None
    }

    pub fn fast(&self) -> bool {
        self.offsets.is_some()
    }

    fn is_exact(&self, obj: &Bound<'_, PyAny>) -> bool {
        // SAFETY: reading the type pointer of a live object.
        unsafe { ffi::Py_TYPE(obj.as_ptr()) == self.cls.as_ptr() as *mut ffi::PyTypeObject }
    }

    /// `obj` with its type checked once, for any number of field reads.
    pub fn view<'a, 'py>(&self, obj: &'a Bound<'py, PyAny>) -> Eco<'a, 'py> {
        let exact_for = if self.is_exact(obj) {
            self.cls_ptr()
        } else {
            std::ptr::null()
        };
        Eco { obj, exact_for }
    }

    fn cls_ptr(&self) -> *const ffi::PyTypeObject {
        self.cls.as_ptr() as *const ffi::PyTypeObject
    }

    /// Field `f` of `eco`.
    #[inline]
    pub fn get<'py>(&self, eco: &Eco<'_, 'py>, f: F) -> PyResult<Bound<'py, PyAny>> {
        let offset = self.offsets.as_ref().map(|offs| offs[f as usize]);
        self.read(eco, offset, &self.names[f as usize])
    }

    /// Whether every `decode_none` field of `eco` is None.
    pub fn decode_none_fields_are_none(&self, eco: &Eco<'_, '_>) -> PyResult<bool> {
        for (i, name) in self.decode_none.iter().enumerate() {
            let offset = self.decode_none_offsets.as_ref().map(|offs| offs[i]);
            if !self.read(eco, offset, name)?.is_none() {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// A field by its slot offset when `eco` is exactly the probed class, else by name.
    #[inline]
    fn read<'py>(
        &self,
        eco: &Eco<'_, 'py>,
        offset: Option<isize>,
        name: &Py<PyString>,
    ) -> PyResult<Bound<'py, PyAny>> {
        if let (Some(off), true) = (offset, eco.exact_for == self.cls_ptr()) {
            // SAFETY: `exact_for` equals our class only when `view` found the
            // object's type to be exactly the class the offsets were probed on, so
            // the slot at this offset holds the field (a strong reference, or NULL).
            let p = unsafe {
                *(eco.obj.as_ptr() as *const u8)
                    .offset(off)
                    .cast::<*mut ffi::PyObject>()
            };
            if !p.is_null() {
                // SAFETY: `p` is a live object owned by `eco.obj`, which outlives this call.
                return Ok(unsafe { Bound::from_borrowed_ptr(eco.obj.py(), p) });
            }
        }
        eco.obj.getattr(name.bind(eco.obj.py()))
    }

    pub fn name<'py>(&self, py: Python<'py>, f: F) -> &Bound<'py, PyString> {
        self.names[f as usize].bind(py)
    }
}
