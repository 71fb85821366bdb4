//! Thin PyO3 binding: `_core.FastCounterInc`, `_core.FastGaugeSet` and
//! `_core.FastHistogramObserve`, callables that stand in for one
//! prometheus_client child's `inc`, `set` or `observe`, and `_core.FastLabels`
//! for a labelled parent's `labels`. `vllm_mmretry.prom` decides which metrics
//! qualify (observable, with `MutexValue` stores, or multiprocess stores, which
//! are updated through their own `inc`/`set`) and hands over their parts.
//! Any call other than the one-positional form vLLM uses goes to the metric's
//! own method, unchanged.

use pyo3::exceptions::PyReferenceError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyFloat, PyInt, PyString, PyTuple, PyWeakrefReference};

use crate::core::guarded;

/// Ints this size or smaller convert to f64 exactly, so comparing the f64 with
/// a bound is Python's int-to-float comparison.
const EXACT_INT: u64 = 1 << 53;

/// A prometheus_client `MutexValue`: the object and its lock's bound
/// `acquire` and `release` (looked up once).
struct MutexCell {
    value: Py<PyAny>,
    acquire: Py<PyAny>,
    release: Py<PyAny>,
}

impl MutexCell {
    fn new(value: &Bound<'_, PyAny>) -> PyResult<Self> {
        let py = value.py();
        let lock = value.getattr(pyo3::intern!(py, "_lock"))?;
        Ok(Self {
            value: value.clone().unbind(),
            acquire: lock.getattr(pyo3::intern!(py, "acquire"))?.unbind(),
            release: lock.getattr(pyo3::intern!(py, "release"))?.unbind(),
        })
    }

    /// `MutexValue.inc`: `with self._lock: self._value += amount`.
    fn inc(&self, py: Python<'_>, amount: &Bound<'_, PyAny>) -> PyResult<()> {
        self.locked(py, |v| {
            let name = pyo3::intern!(py, "_value");
            let current = v.getattr(name)?;
            // `+=`, not `+`: the same result, and the same error text for a bad amount.
            // SAFETY: both pointers are live objects; the call returns a new reference or NULL.
            let sum = unsafe {
                Bound::from_owned_ptr_or_err(
                    py,
                    pyo3::ffi::PyNumber_InPlaceAdd(current.as_ptr(), amount.as_ptr()),
                )?
            };
            v.setattr(name, sum)
        })
    }

    /// `MutexValue.set` without a timestamp: `with self._lock: self._value = value`.
    fn set(&self, py: Python<'_>, value: &Bound<'_, PyAny>) -> PyResult<()> {
        self.locked(py, |v| v.setattr(pyo3::intern!(py, "_value"), value))
    }

    /// Runs `f` holding the value's lock, released whatever `f` returns.
    fn locked(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&Bound<'_, PyAny>) -> PyResult<()>,
    ) -> PyResult<()> {
        self.acquire.bind(py).call0()?;
        let done = f(self.value.bind(py));
        self.release.bind(py).call0()?;
        done
    }
}

/// A value updated through its own `inc` and `set`: prometheus_client's
/// multiprocess `MmapedValue`, whose updates also take the process-wide lock,
/// check for a fork and write the process's file (all prometheus_client's code).
struct MethodStore {
    inc: Py<PyAny>,
    set: Py<PyAny>,
}

/// Where a child's number is stored, and how this binding updates it.
enum Store {
    Mutex(MutexCell),
    Methods(MethodStore),
}

impl MethodStore {
    fn new(value: &Bound<'_, PyAny>) -> PyResult<Self> {
        let py = value.py();
        Ok(MethodStore {
            inc: value.getattr(pyo3::intern!(py, "inc"))?.unbind(),
            set: value.getattr(pyo3::intern!(py, "set"))?.unbind(),
        })
    }
}

impl Store {
    fn new(value: &Bound<'_, PyAny>, own_methods: bool) -> PyResult<Self> {
        if own_methods {
            MethodStore::new(value).map(Store::Methods)
        } else {
            MutexCell::new(value).map(Store::Mutex)
        }
    }

    /// The value's `inc(amount)`.
    fn inc(&self, py: Python<'_>, amount: &Bound<'_, PyAny>) -> PyResult<()> {
        match self {
            Store::Mutex(m) => m.inc(py, amount),
            Store::Methods(o) => o.inc.bind(py).call1((amount,)).map(drop),
        }
    }

    /// The value's `set(value)`, or `set(value, timestamp=...)` as `Gauge.set`
    /// calls it for a "mostrecent" gauge (a `MutexValue` ignores the timestamp).
    fn set(
        &self,
        py: Python<'_>,
        value: &Bound<'_, PyAny>,
        timestamp: Option<Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        match (self, timestamp) {
            (Store::Mutex(m), _) => m.set(py, value),
            (Store::Methods(o), None) => o.set.bind(py).call1((value,)).map(drop),
            (Store::Methods(o), Some(ts)) => {
                let kwargs = PyDict::new(py);
                kwargs.set_item(pyo3::intern!(py, "timestamp"), ts)?;
                o.set.bind(py).call((value,), Some(&kwargs)).map(drop)
            }
        }
    }
}

/// The one argument of a plain call (`m.inc(x)`), or None for any other form.
fn single_arg<'py>(
    args: &Bound<'py, PyTuple>,
    kwargs: Option<&Bound<'py, PyDict>>,
) -> Option<Bound<'py, PyAny>> {
    if kwargs.is_some_and(|k| !k.is_empty()) || args.len() != 1 {
        return None;
    }
    args.get_item(0).ok()
}

/// Calls the child's own method through `original`, a `weakref.WeakMethod`: a
/// strong reference would be a cycle (child -> this -> child) that the
/// collector cannot see through a Rust object, so a dropped child would leak.
fn call_original(
    original: &Py<PyAny>,
    args: &Bound<'_, PyTuple>,
    kwargs: Option<&Bound<'_, PyDict>>,
) -> PyResult<()> {
    let method = original.bind(args.py()).call0()?;
    if method.is_none() {
        return Err(PyReferenceError::new_err(
            "the metric this update belongs to no longer exists",
        ));
    }
    method.call(args, kwargs).map(drop)
}

/// Runs `update` on a plain call's argument (`default` when the call has no
/// argument and the method has one). Any other call form, or an update that
/// declines (`None`), goes to the child's own method.
fn dispatch(
    what: &str,
    original: &Py<PyAny>,
    args: &Bound<'_, PyTuple>,
    kwargs: Option<&Bound<'_, PyDict>>,
    default: Option<i64>,
    update: impl FnOnce(&Bound<'_, PyAny>) -> PyResult<Option<()>>,
) -> PyResult<()> {
    guarded(what, || {
        let no_kwargs = kwargs.is_none_or(|k| k.is_empty());
        let arg = match (single_arg(args, kwargs), default) {
            (Some(a), _) => a,
            (None, Some(d)) if args.is_empty() && no_kwargs => PyInt::new(args.py(), d).into_any(),
            _ => return call_original(original, args, kwargs),
        };
        match update(&arg)? {
            Some(()) => Ok(()),
            None => call_original(original, args, kwargs),
        }
    })?
}

fn is_int_zero(amount: &Bound<'_, PyAny>) -> bool {
    amount.is_exact_instance_of::<PyInt>() && amount.extract::<i64>().is_ok_and(|v| v == 0)
}

/// A single-value child's store and its own method.
struct Single {
    cell: Store,
    original: Py<PyAny>,
}

impl Single {
    fn new(value: &Bound<'_, PyAny>, original: Py<PyAny>, own_methods: bool) -> PyResult<Self> {
        Ok(Self {
            cell: Store::new(value, own_methods)?,
            original,
        })
    }
}

/// `Counter.inc` for one observable child.
#[pyclass(frozen, module = "vllm_mmretry._core")]
pub struct FastCounterInc(Single);

#[pymethods]
impl FastCounterInc {
    #[new]
    #[pyo3(signature = (value, original, *, own_methods = false))]
    fn new(value: &Bound<'_, PyAny>, original: Py<PyAny>, own_methods: bool) -> PyResult<Self> {
        Single::new(value, original, own_methods).map(Self)
    }

    #[pyo3(signature = (*args, **kwargs))]
    fn __call__(
        &self,
        args: &Bound<'_, PyTuple>,
        kwargs: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<()> {
        let Single { cell, original } = &self.0;
        dispatch("Counter.inc", original, args, kwargs, Some(1), |amount| {
            // A negative amount: the original raises prometheus_client's error.
            if amount.lt(0)? {
                return Ok(None);
            }
            // `+= 0` of an int leaves any number the stored value can be as it was
            // (most of vLLM's increments per message are of zero). A multiprocess
            // value's file already holds the key (written when the value was made);
            // what its `inc(0)` would also do is notice a fork, which the next
            // non-zero update still does (vLLM makes its metrics after its forks).
            if is_int_zero(amount) {
                return Ok(Some(()));
            }
            cell.inc(amount.py(), amount).map(Some)
        })
    }
}

/// `Gauge.set` for one observable child. A "mostrecent" gauge passes the time
/// too: `clock` is then `time.time`. (A `MutexValue` ignores the timestamp, so
/// its gauges get no clock.)
#[pyclass(frozen, module = "vllm_mmretry._core")]
pub struct FastGaugeSet {
    single: Single,
    clock: Option<Py<PyAny>>,
}

#[pymethods]
impl FastGaugeSet {
    #[new]
    #[pyo3(signature = (value, original, *, own_methods = false, clock = None))]
    fn new(
        value: &Bound<'_, PyAny>,
        original: Py<PyAny>,
        own_methods: bool,
        clock: Option<Py<PyAny>>,
    ) -> PyResult<Self> {
        Ok(Self {
            single: Single::new(value, original, own_methods)?,
            clock,
        })
    }

    #[pyo3(signature = (*args, **kwargs))]
    fn __call__(
        &self,
        args: &Bound<'_, PyTuple>,
        kwargs: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<()> {
        let Single { cell, original } = &self.single;
        dispatch("Gauge.set", original, args, kwargs, None, |value| {
            let py = value.py();
            // `float(value)`: an exact float is itself.
            let value = if value.is_exact_instance_of::<PyFloat>() {
                value.clone()
            } else {
                py.get_type::<PyFloat>().call1((value,))?
            };
            let timestamp = match &self.clock {
                Some(clock) => Some(clock.bind(py).call0()?),
                None => None,
            };
            cell.set(py, &value, timestamp).map(Some)
        })
    }
}

/// `Histogram.observe` for one observable child.
#[pyclass(frozen, module = "vllm_mmretry._core")]
pub struct FastHistogramObserve {
    sum: Store,
    buckets: Vec<Store>,
    /// `_upper_bounds`, as Python floats (for amounts of other types) and as f64.
    bounds: Vec<Py<PyAny>>,
    bounds_f64: Vec<f64>,
    original: Py<PyAny>,
}

#[pymethods]
impl FastHistogramObserve {
    #[new]
    #[pyo3(signature = (sum, buckets, bounds, original, *, own_methods = false))]
    fn new(
        sum: &Bound<'_, PyAny>,
        buckets: Vec<Bound<'_, PyAny>>,
        bounds: Vec<Bound<'_, PyFloat>>,
        original: Py<PyAny>,
        own_methods: bool,
    ) -> PyResult<Self> {
        if buckets.len() != bounds.len() {
            return Err(pyo3::exceptions::PyValueError::new_err(
                "a histogram needs one bucket per upper bound",
            ));
        }
        Ok(Self {
            sum: Store::new(sum, own_methods)?,
            buckets: buckets
                .iter()
                .map(|b| Store::new(b, own_methods))
                .collect::<PyResult<_>>()?,
            bounds_f64: bounds.iter().map(|b| b.value()).collect(),
            bounds: bounds.into_iter().map(|b| b.into_any().unbind()).collect(),
            original,
        })
    }

    #[pyo3(signature = (*args, **kwargs))]
    fn __call__(
        &self,
        args: &Bound<'_, PyTuple>,
        kwargs: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<()> {
        dispatch(
            "Histogram.observe",
            &self.original,
            args,
            kwargs,
            None,
            |amount| {
                let py = amount.py();
                self.sum.inc(py, amount)?;
                if let Some(i) = self.bucket(amount)? {
                    self.buckets[i].inc(py, PyInt::new(py, 1).as_any())?;
                }
                Ok(Some(()))
            },
        )
    }
}

impl FastHistogramObserve {
    /// The bucket `observe` counts `amount` in, compared as Python compares it.
    fn bucket(&self, amount: &Bound<'_, PyAny>) -> PyResult<Option<usize>> {
        if let Ok(f) = amount.cast_exact::<PyFloat>() {
            return Ok(super::bucket_for(&self.bounds_f64, f.value()));
        }
        if let Ok(i) = amount.cast_exact::<PyInt>() {
            if let Ok(v) = i.extract::<i64>() {
                if v.unsigned_abs() <= EXACT_INT {
                    return Ok(super::bucket_for(&self.bounds_f64, v as f64));
                }
            }
        }
        for (i, bound) in self.bounds.iter().enumerate() {
            if amount.le(bound.bind(amount.py()))? {
                return Ok(Some(i));
            }
        }
        Ok(None)
    }
}

/// `labels` for one labelled parent metric. A call with only `str` label values
/// whose child exists returns that child (`parent._metrics[values]`, what
/// prometheus_client returns for them); every other call goes to `miss`, which
/// runs the parent's own `labels`.
#[pyclass(frozen, module = "vllm_mmretry._core")]
pub struct FastLabels {
    /// Weak, as the `original` of the updates above: the parent holds this.
    parent: Py<PyWeakrefReference>,
    miss: Py<PyAny>,
}

#[pymethods]
impl FastLabels {
    #[new]
    fn new(parent: Py<PyWeakrefReference>, miss: Py<PyAny>) -> Self {
        Self { parent, miss }
    }

    #[pyo3(signature = (*args, **kwargs))]
    fn __call__<'py>(
        &self,
        args: &Bound<'py, PyTuple>,
        kwargs: Option<&Bound<'py, PyDict>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let py = args.py();
        let existing = guarded("labels", || self.existing_child(args, kwargs))??;
        match existing {
            Some(child) => Ok(child),
            None => self.miss.bind(py).call(args, kwargs),
        }
    }
}

impl FastLabels {
    fn existing_child<'py>(
        &self,
        args: &Bound<'py, PyTuple>,
        kwargs: Option<&Bound<'py, PyDict>>,
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        let py = args.py();
        let plain = kwargs.is_none_or(|k| k.is_empty())
            && args.iter().all(|a| a.is_exact_instance_of::<PyString>());
        let Some(parent) = self.parent.bind(py).upgrade().filter(|_| plain) else {
            return Ok(None);
        };
        let metrics = parent.getattr(pyo3::intern!(py, "_metrics"))?;
        match metrics.cast_exact::<PyDict>() {
            Ok(d) => d.get_item(args),
            Err(_) => Ok(None),
        }
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<FastLabels>()?;
    m.add_class::<FastCounterInc>()?;
    m.add_class::<FastGaugeSet>()?;
    m.add_class::<FastHistogramObserve>()?;
    Ok(())
}
