//! Thin PyO3 view of the engine-output reader (`_core.OutputsReader`): builds vLLM's
//! `EngineCoreOutputs` from a message `wire::read` accepts, through the classes and
//! decoders the adapter hands over (`vllm_adapter.base.OutputsWire`).

use pyo3::buffer::PyBuffer;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes, PyDict, PyList, PyMemoryView, PyString, PyTuple, PyType};

use super::{read, Kind, Layout, Val};
use crate::core::guarded;

/// An output's constructor arguments: positional, and keywords when any.
type OutputArgs<'py> = (Bound<'py, PyTuple>, Option<Bound<'py, PyDict>>);

/// The adapter's `OutputsWire`, read by attribute.
#[derive(FromPyObject)]
struct Schema {
    outputs_cls: Py<PyType>,
    output_cls: Py<PyType>,
    top_fields: usize,
    outputs_at: usize,
    output_fields: Vec<String>,
    output_kinds: Vec<String>,
    output_required: usize,
    /// Per top-level field: its default is None (a trailing None need not be passed).
    top_none_default: Vec<bool>,
    /// `FinishReason` members, indexed by value.
    finish_reasons: Vec<Py<PyAny>>,
    /// Per top-level field, vLLM's decoder for its type (None at `outputs_at`).
    field_decoders: Vec<Option<Py<PyAny>>>,
}

/// The schema's spelling of each kind, both ways.
const KIND_NAMES: [(&str, Kind); 6] = [
    ("str", Kind::Str),
    ("int_list", Kind::IntList),
    ("opt_enum", Kind::OptEnum),
    ("opt_int_or_str", Kind::OptIntOrStr),
    ("int", Kind::Int),
    ("nil", Kind::Nil),
];

fn kind(name: &str) -> PyResult<Kind> {
    KIND_NAMES
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, k)| *k)
        .ok_or_else(|| PyValueError::new_err(format!("unknown field kind {name:?}")))
}

fn kind_name(kind: Kind) -> &'static str {
    KIND_NAMES
        .iter()
        .find(|(_, k)| *k == kind)
        .map_or("?", |(n, _)| n)
}

/// Reads engine-output messages of the common shape into vLLM's objects.
#[pyclass(frozen, module = "vllm_mmretry._core")]
pub struct OutputsReader {
    layout: Layout,
    outputs_cls: Py<PyType>,
    output_cls: Py<PyType>,
    output_names: Vec<Py<PyString>>,
    top_none_default: Vec<bool>,
    finish_reasons: Vec<Py<PyAny>>,
    field_decoders: Vec<Option<Py<PyAny>>>,
}

#[pymethods]
impl OutputsReader {
    #[new]
    fn new(schema: &Bound<'_, PyAny>) -> PyResult<Self> {
        let py = schema.py();
        let s: Schema = schema.extract()?;
        let kinds = s
            .output_kinds
            .iter()
            .map(|k| kind(k))
            .collect::<PyResult<Vec<_>>>()?;
        let top_ok = s.field_decoders.len() == s.top_fields
            && s.top_none_default.len() == s.top_fields
            && s.outputs_at < s.top_fields;
        if !top_ok || s.output_fields.len() != kinds.len() {
            return Err(PyValueError::new_err(
                "field_decoders and top_none_default must name every top-level field, \
                 output_fields every output field",
            ));
        }
        if s.output_required > kinds.len() {
            return Err(PyValueError::new_err(
                "output_required exceeds the output fields",
            ));
        }
        Ok(Self {
            layout: Layout {
                top_fields: s.top_fields,
                outputs_at: s.outputs_at,
                output: kinds,
                output_required: s.output_required,
            },
            outputs_cls: s.outputs_cls,
            output_cls: s.output_cls,
            output_names: s
                .output_fields
                .iter()
                .map(|n| PyString::intern(py, n).unbind())
                .collect(),
            top_none_default: s.top_none_default,
            finish_reasons: s.finish_reasons,
            field_decoders: s.field_decoders,
        })
    }

    /// vLLM's `EngineCoreOutputs` for one frame (bytes or any C-contiguous buffer),
    /// or None when the message is not of the common shape.
    fn read<'py>(&self, frame: &Bound<'py, PyAny>) -> PyResult<Option<Bound<'py, PyAny>>> {
        let py = frame.py();
        if let Ok(b) = frame.cast::<PyBytes>() {
            return self.build(py, b.as_bytes());
        }
        // pyzmq's Frame exports no strides, which PyBuffer requires; a memoryview of it does.
        let buf = match PyBuffer::<u8>::get(frame) {
            Ok(b) => b,
            Err(_) => PyBuffer::<u8>::get(PyMemoryView::from(frame)?.as_any())?,
        };
        if !buf.is_c_contiguous() {
            return Ok(None);
        }
        // SAFETY: `buf` holds the exporter's buffer (released on drop, after the last
        // use of the slice) and is C-contiguous, so its bytes are one readable block.
        let bytes =
            unsafe { std::slice::from_raw_parts(buf.buf_ptr() as *const u8, buf.len_bytes()) };
        self.build(py, bytes)
    }

    /// Which kind each `EngineCoreOutput` field was given, as the schema spells it.
    #[getter]
    fn output_kinds(&self) -> Vec<&'static str> {
        self.layout.output.iter().map(|k| kind_name(*k)).collect()
    }
}

impl OutputsReader {
    /// `build_objects`, with a bug there (a panic, reading or building) a RuntimeError for
    /// this message, which the decoder answers with vLLM's own, instead of a PanicException.
    fn build<'py>(&self, py: Python<'py>, bytes: &[u8]) -> PyResult<Option<Bound<'py, PyAny>>> {
        guarded("read engine outputs", || self.build_objects(py, bytes))?
    }

    fn build_objects<'py>(
        &self,
        py: Python<'py>,
        bytes: &[u8],
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        let Some(msg) = read(&self.layout, bytes) else {
            return Ok(None);
        };
        let outputs = PyList::empty(py);
        for fields in &msg.outputs {
            let Some((args, kwargs)) = self.output_args(py, fields)? else {
                return Ok(None);
            };
            outputs.append(self.output_cls.bind(py).call(args, kwargs.as_ref())?)?;
        }
        // Trailing Nones whose default is None are left to the class (fewer arguments).
        let mut n = msg.top.len();
        while n > 0 && msg.top[n - 1].is_none() && n - 1 != self.layout.outputs_at {
            if !self.top_none_default[n - 1] {
                break;
            }
            n -= 1;
        }
        let mut top = Vec::with_capacity(n);
        for (i, raw) in msg.top[..n].iter().enumerate() {
            top.push(
                match (i == self.layout.outputs_at, raw, &self.field_decoders[i]) {
                    (true, _, _) => outputs.clone().into_any(),
                    // A nil where the field's type takes no None: vLLM's decoder's error.
                    (false, None, _) if !self.top_none_default[i] => return Ok(None),
                    (false, None, _) => py.None().into_bound(py),
                    // A writable copy: vLLM decodes from the (writable) frame, and arrays
                    // it decodes in place share that buffer.
                    (false, Some(raw), Some(decode)) => {
                        decode.bind(py).call1((PyByteArray::new(py, raw),))?
                    }
                    (false, Some(_), None) => return Ok(None),
                },
            );
        }
        Ok(Some(
            self.outputs_cls.bind(py).call1(PyTuple::new(py, top)?)?,
        ))
    }

    /// The required fields by position, the others by keyword where not their default.
    fn output_args<'py>(
        &self,
        py: Python<'py>,
        fields: &[Val<'_>],
    ) -> PyResult<Option<OutputArgs<'py>>> {
        let required = self.layout.output_required;
        let mut args = Vec::with_capacity(required);
        let mut kwargs: Option<Bound<'py, PyDict>> = None;
        for (i, (val, kind)) in fields.iter().zip(&self.layout.output).enumerate() {
            let default =
                matches!(val, Val::Nil) || matches!((val, kind), (Val::Int(0), Kind::Int));
            if i >= required && default {
                continue;
            }
            let value = match (val, kind) {
                (Val::Nil, _) => py.None().into_bound(py),
                (Val::Int(v), Kind::OptEnum) => {
                    let member = usize::try_from(*v)
                        .ok()
                        .and_then(|i| self.finish_reasons.get(i));
                    match member {
                        Some(m) => m.bind(py).clone(),
                        None => return Ok(None), // not a member: vLLM's decoder says so
                    }
                }
                (Val::Int(v), _) => v.into_pyobject(py)?.into_any(),
                (Val::Str(s), _) => PyString::new(py, s).into_any(),
                (Val::Ints(ids), _) => PyList::new(py, ids)?.into_any(),
            };
            if i < required {
                args.push(value);
            } else {
                kwargs
                    .get_or_insert_with(|| PyDict::new(py))
                    .set_item(self.output_names[i].bind(py), value)?;
            }
        }
        Ok(Some((PyTuple::new(py, args)?, kwargs)))
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<OutputsReader>()
}
