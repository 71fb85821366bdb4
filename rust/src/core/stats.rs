//! Native request statistics for plain decode steps.
//!
//! With statistics on, vLLM calls `IterationStats.update_from_output` for every
//! request in every step. For an output that is past prefill, carries no engine
//! events and no NaN count, that update is four writes: the iteration's and the
//! request's generation-token counts grow by the step's tokens, the
//! inter-token latency is appended, and the request's `last_token_ts` becomes
//! the step's timestamp. The core does exactly that here (names from the
//! adapter's `ObjectFields`), writing through to vLLM's own `RequestStateStats`
//! so everything that reads it (finished-request stats, `RequestOutput.metrics`,
//! tracing) sees what stock would. Any other output, or a value of another type
//! than vLLM's, goes to vLLM's function. The adapter's self-check
//! (`check_native_stats`) runs both on the same outputs at start-up and turns
//! this off when they differ.

use std::cell::Cell;

use pyo3::prelude::*;
use pyo3::types::{PyFloat, PyInt, PyList, PyString};

use super::ObjFields;
use crate::eco::{Eco, EcoReader, F};

/// One step's native statistics: its timestamp and the IterationStats it feeds.
pub(super) struct DecodeStats<'py> {
    /// The engine-core timestamp, stored as `last_token_ts` unchanged.
    ts: Bound<'py, PyFloat>,
    ts_value: f64,
    /// `IterationStats.inter_token_latencies_iter`.
    itl: Bound<'py, PyList>,
    /// Generation tokens recorded natively this step, added to the
    /// IterationStats once by `flush` (a sum, so order does not matter).
    tokens: Cell<i64>,
}

impl<'py> DecodeStats<'py> {
    /// The step's native statistics, when the timestamp is a float and the
    /// IterationStats' latency list is a list (as vLLM builds them); else None.
    pub(super) fn for_step(
        names: &ObjFields,
        ts: &Bound<'py, PyAny>,
        its: &Bound<'py, PyAny>,
    ) -> PyResult<Option<Self>> {
        let py = its.py();
        let Ok(ts) = ts.cast_exact::<PyFloat>() else {
            return Ok(None);
        };
        let Ok(itl) = its.getattr(names.iteration_inter_token_latencies.bind(py)) else {
            return Ok(None);
        };
        let Ok(itl) = itl.cast_into_exact::<PyList>() else {
            return Ok(None);
        };
        Ok(Some(Self {
            ts: ts.clone(),
            ts_value: ts.value(),
            itl,
            tokens: Cell::new(0),
        }))
    }

    /// One request's decode step, as `update_from_output` does it for an output
    /// with no events and no NaNs past prefill. False (nothing written) when the
    /// request's stats do not hold vLLM's types.
    pub(super) fn record(
        &self,
        names: &ObjFields,
        req_stats: &Bound<'py, PyAny>,
        num_tokens: usize,
    ) -> PyResult<bool> {
        let py = req_stats.py();
        let Some(last) = float_attr(req_stats, names.stats_last_token_ts.bind(py)) else {
            return Ok(false);
        };
        let Some(count) = int_attr(req_stats, names.stats_num_generation_tokens.bind(py)) else {
            return Ok(false);
        };
        let Ok(n) = i64::try_from(num_tokens) else {
            return Ok(false);
        };
        let Some(count) = count.checked_add(n) else {
            return Ok(false);
        };
        req_stats.setattr(names.stats_num_generation_tokens.bind(py), count)?;
        self.itl.append(PyFloat::new(py, self.ts_value - last))?;
        req_stats.setattr(names.stats_last_token_ts.bind(py), &self.ts)?;
        self.tokens.set(self.tokens.get() + n);
        Ok(true)
    }

    /// Adds the step's natively recorded tokens to the IterationStats.
    pub(super) fn flush(&self, names: &ObjFields, its: &Bound<'py, PyAny>) -> PyResult<()> {
        let n = self.tokens.replace(0);
        if n == 0 {
            return Ok(());
        }
        let name = names.iteration_num_generation_tokens.bind(its.py());
        let total = its.getattr(name)?.add(n)?;
        its.setattr(name, total)
    }
}

// A missing attribute (no stats object, another vLLM) is None too: vLLM's
// function then runs and fails, or not, as it does in stock.
fn float_attr(obj: &Bound<'_, PyAny>, name: &Bound<'_, PyString>) -> Option<f64> {
    let v = obj.getattr(name).ok()?;
    Some(v.cast_exact::<PyFloat>().ok()?.value())
}

fn int_attr(obj: &Bound<'_, PyAny>, name: &Bound<'_, PyString>) -> Option<i64> {
    let v = obj.getattr(name).ok()?;
    v.cast_exact::<PyInt>().ok()?.extract::<i64>().ok()
}

/// A request's statistics for one output natively, when it is a plain decode
/// step (the caller checked the request is past prefill): whether it did.
pub(super) fn record_plain_decode<'py>(
    d: &DecodeStats<'py>,
    names: &ObjFields,
    er: &EcoReader,
    ev: &Eco<'_, 'py>,
    req_stats: &Bound<'py, PyAny>,
    new_ids: &Bound<'py, PyAny>,
) -> PyResult<bool> {
    if !is_plain_decode(&er.get(ev, F::Events)?, &er.get(ev, F::NumNansInLogits)?)
        || !er.decode_none_fields_are_none(ev)?
    {
        return Ok(false);
    }
    d.record(names, req_stats, new_ids.len()?)
}

/// Whether an output is a plain decode step for the native statistics: no
/// engine events, and a NaN count that is exactly the int 0 (the caller also
/// checks the version's `decode_none` fields).
fn is_plain_decode(events: &Bound<'_, PyAny>, nans: &Bound<'_, PyAny>) -> bool {
    events.is_none()
        && nans
            .cast_exact::<PyInt>()
            .is_ok_and(|i| i.extract::<i64>().is_ok_and(|v| v == 0))
}
