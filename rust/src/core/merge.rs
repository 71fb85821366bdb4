//! Native collector merge: vLLM's `RequestOutput.add(next, aggregate=True)` for a
//! fast n = 1 DELTA request whose collector still holds an output the consumer has
//! not taken (the consumer is behind, e.g. while the engine is ahead of the API
//! server). The step's fields are merged into that output instead of building a new
//! `RequestOutput` and calling vLLM's `add` in Python.
//!
//! The field rules come from the adapter (`vllm_adapter.base.MergeFields`), and its
//! self-check (`check_native_merge`) runs vLLM's `add` and this merge on the same
//! outputs at start-up, with every field of the next output distinct; any difference
//! turns the native merge off. Anything unusual (another type, several completions,
//! another index, logprobs or a sampling mask to merge, token ids that are not a
//! list) is left to vLLM's `add`.

use super::*;

/// A list that keeps its first `N` items inline and only further ones on the heap.
pub(super) struct SmallList<T, const N: usize> {
    inline: [Option<T>; N],
    n_inline: usize,
    more: Vec<T>,
}

impl<T, const N: usize> SmallList<T, N> {
    pub(super) fn new() -> Self {
        Self {
            inline: [const { None }; N],
            n_inline: 0,
            more: Vec::new(),
        }
    }

    pub(super) fn push(&mut self, item: T) {
        match self.inline.get_mut(self.n_inline) {
            Some(slot) => {
                *slot = Some(item);
                self.n_inline += 1;
            }
            None => self.more.push(item),
        }
    }

    /// The items in the order pushed.
    pub(super) fn iter(&self) -> impl DoubleEndedIterator<Item = &T> {
        self.inline[..self.n_inline]
            .iter()
            .flatten()
            .chain(self.more.iter())
    }

    fn iter_mut(&mut self) -> impl Iterator<Item = &mut T> {
        self.inline[..self.n_inline]
            .iter_mut()
            .flatten()
            .chain(self.more.iter_mut())
    }
}

/// How many step values a `NextFields` holds without allocating: a completion sets
/// at most six (text, token ids, finish and stop reason, speculative-decoding
/// metrics, weight versions), a RequestOutput four.
const INLINE_VALUES: usize = 6;

/// How many values of its own a request's template keeps inline: a RequestOutput's
/// are its id, prompt, prompt token ids, statistics, LoRA request and, after
/// prefill, its two cached-token counts.
const OWN_VALUES: usize = 7;

/// A request's output dict before a step's values: `base` with the request's own
/// values set over it. `base` is the processor's shared template whenever the
/// request's differs from it only in values (the usual case), so at big batches
/// every request copies the same dict, in cache, instead of its own cold one.
pub(super) struct Template {
    base: Py<PyDict>,
    own: SmallList<(Py<PyString>, Py<PyAny>), OWN_VALUES>,
}

impl Template {
    /// The request's whole template as its base (nothing shared).
    pub(super) fn whole(full: Bound<'_, PyDict>) -> Self {
        Self {
            base: full.unbind(),
            own: SmallList::new(),
        }
    }

    /// `full` as `shared` plus the values that are not the same objects in both,
    /// when both have the same keys in the same order (so the copy's order is
    /// `full`'s); otherwise `full` itself.
    pub(super) fn split(full: Bound<'_, PyDict>, shared: Option<&Bound<'_, PyDict>>) -> Self {
        let Some(shared) = shared.filter(|s| s.len() == full.len()) else {
            return Self::whole(full);
        };
        let py = full.py();
        let mut own = SmallList::new();
        for ((k, v), (sk, sv)) in full.iter().zip(shared.iter()) {
            let same_key = k.is(&sk) || k.eq(&sk).unwrap_or(false);
            let Ok(name) = sk.cast_into::<PyString>() else {
                return Self::whole(full);
            };
            if !same_key {
                return Self::whole(full);
            }
            if !v.is(&sv) {
                let Ok(name) = name.to_str().map(|n| PyString::intern(py, n)) else {
                    return Self::whole(full);
                };
                own.push((name.unbind(), v.unbind()));
            }
        }
        Self {
            base: shared.clone().unbind(),
            own,
        }
    }

    /// Prefetch the request's own values (each output's dict references them).
    pub(super) fn prefetch_own(&self) {
        for (_, v) in self.own.iter() {
            super::ahead::object(v);
        }
    }

    /// Set `name` (an interned field name) for every later output of the request.
    pub(super) fn set(&mut self, py: Python<'_>, name: &Py<PyString>, value: Py<PyAny>) {
        if let Some(slot) = self.own.iter_mut().find(|(n, _)| n.is(name)) {
            slot.1 = value;
            return;
        }
        self.own.push((name.clone_ref(py), value));
    }
}

/// The fields of a next output (a RequestOutput or its completion) without building
/// its dict: the step's values over the request's template. A merged step's output is
/// never handed out, so copying the template for it would be wasted.
pub(super) struct NextFields<'a, 'py> {
    base: Bound<'py, PyDict>,
    own: &'a SmallList<(Py<PyString>, Py<PyAny>), OWN_VALUES>,
    /// The step's values, by interned field name (looked up by identity: every
    /// name in the core and in the merge rules is interned).
    set: SmallList<(&'a Py<PyString>, Bound<'py, PyAny>), INLINE_VALUES>,
}

impl<'a, 'py> NextFields<'a, 'py> {
    pub(super) fn new(py: Python<'py>, template: &'a Template) -> Self {
        Self {
            base: template.base.bind(py).clone(),
            own: &template.own,
            set: SmallList::new(),
        }
    }

    pub(super) fn set(&mut self, name: &'a Py<PyString>, value: Bound<'py, PyAny>) {
        self.set.push((name, value));
    }

    /// The value for `name` (the last one set, else the request's own, else the
    /// shared template's; a missing field reads as None).
    fn get(&self, name: &Py<PyString>) -> PyResult<Bound<'py, PyAny>> {
        let py = self.base.py();
        if let Some((_, v)) = self.set.iter().rev().find(|(n, _)| n.is(name)) {
            return Ok(v.clone());
        }
        if let Some((_, v)) = self.own.iter().find(|(n, _)| n.is(name)) {
            return Ok(v.bind(py).clone());
        }
        Ok(self
            .base
            .get_item(name.bind(py))?
            .unwrap_or_else(|| py.None().into_bound(py)))
    }

    /// The output's dict: a copy of the template with the step's values.
    pub(super) fn into_dict(self) -> PyResult<Bound<'py, PyDict>> {
        let py = self.base.py();
        let d = self.base.copy()?;
        for (name, value) in self.own.iter() {
            d.set_item(name.bind(py), value.bind(py))?;
        }
        for (name, value) in self.set.iter() {
            d.set_item(name.bind(py), value)?;
        }
        Ok(d)
    }
}

/// `RequestOutput.add`'s rules for the fields of one completion of the same index.
pub(super) struct MergeRules {
    index: Py<PyString>,
    /// `completion.f += next.f` (text).
    concatenated: Vec<Py<PyString>>,
    /// `completion.f.extend(next.f)` (token ids).
    extended: Vec<Py<PyString>>,
    /// Merged by vLLM in ways the native merge does not do: a next value other
    /// than None leaves the merge to vLLM (logprobs, sampling mask).
    refused: Vec<Py<PyString>>,
    /// `if next.f is not None: completion.f = next.f`.
    kept_unless_none: Vec<Py<PyString>>,
    /// `completion.f = next.f`.
    replaced: Vec<Py<PyString>>,
    /// RequestOutput: `self.f |= next.f` (finished).
    ro_or: Vec<Py<PyString>>,
    /// RequestOutput: `self.f = next.f` (transfer params).
    ro_replaced: Vec<Py<PyString>>,
    /// RequestOutput: kept unless next's is None (our `error`).
    ro_kept_unless_none: Vec<Py<PyString>>,
}

/// `vllm_adapter.base.MergeFields`.
#[derive(FromPyObject)]
pub(super) struct MergeFieldNames {
    index: String,
    concatenated: Vec<String>,
    extended: Vec<String>,
    refused: Vec<String>,
    kept_unless_none: Vec<String>,
    replaced: Vec<String>,
    ro_or: Vec<String>,
    ro_replaced: Vec<String>,
    ro_kept_unless_none: Vec<String>,
}

fn interned(py: Python<'_>, names: &[String]) -> Vec<Py<PyString>> {
    names
        .iter()
        .map(|n| PyString::intern(py, n).unbind())
        .collect()
}

impl MergeRules {
    pub(super) fn new(py: Python<'_>, n: &MergeFieldNames) -> Self {
        Self {
            index: PyString::intern(py, &n.index).unbind(),
            concatenated: interned(py, &n.concatenated),
            extended: interned(py, &n.extended),
            refused: interned(py, &n.refused),
            kept_unless_none: interned(py, &n.kept_unless_none),
            replaced: interned(py, &n.replaced),
            ro_or: interned(py, &n.ro_or),
            ro_replaced: interned(py, &n.ro_replaced),
            ro_kept_unless_none: interned(py, &n.ro_kept_unless_none),
        }
    }

    /// `obj.f = next.f` for each name, written into `obj`'s instance dict; with
    /// `unless_none`, only where next's is not None. A value that is already the
    /// same object (None over None, most steps) is left alone.
    fn assign_each(
        obj: &Bound<'_, PyDict>,
        next: &NextFields<'_, '_>,
        names: &[Py<PyString>],
        unless_none: bool,
    ) -> PyResult<()> {
        let py = obj.py();
        for name in names {
            let v = next.get(name)?;
            if unless_none && v.is_none() {
                continue;
            }
            let name = name.bind(py);
            if obj.get_item(name)?.is_some_and(|cur| cur.is(&v)) {
                continue;
            }
            obj.set_item(name, v)?;
        }
        Ok(())
    }

    /// Whether `co` (the instance dict of a RequestOutput's one completion) can take
    /// `next_co` natively, and `ro` (the RequestOutput's) has what the merge reads;
    /// checked in full before anything is written.
    fn accepts(
        &self,
        ro: &Bound<'_, PyDict>,
        co: &Bound<'_, PyDict>,
        next_co: &NextFields<'_, '_>,
    ) -> PyResult<bool> {
        let py = co.py();
        for name in &self.refused {
            if !next_co.get(name)?.is_none() {
                return Ok(false);
            }
        }
        for name in &self.extended {
            if !co
                .get_item(name.bind(py))?
                .is_some_and(|v| v.is_exact_instance_of::<PyList>())
            {
                return Ok(false);
            }
        }
        // Read below: a field only the class has (a default) is left to vLLM's add.
        for name in &self.concatenated {
            if !co.contains(name.bind(py))? {
                return Ok(false);
            }
        }
        for name in &self.ro_or {
            if !ro.contains(name.bind(py))? {
                return Ok(false);
            }
        }
        let index = next_co.get(&self.index)?;
        match co.get_item(self.index.bind(py))? {
            Some(cur) => cur.eq(index),
            None => Ok(false),
        }
    }

    /// Merge `next` (the fields of the next RequestOutput and of its one
    /// completion) into `cur` as `cur.add(next, aggregate=True)` would. Returns
    /// false, having written nothing, when it is left to vLLM's `add`. The fields
    /// are read and written in the instance dicts: the adapter's self-check
    /// (`check_native_merge`) compares them with vLLM's add on the running vLLM.
    pub(super) fn merge(
        &self,
        cur: &Bound<'_, PyAny>,
        cur_co: &Bound<'_, PyAny>,
        next_ro: &NextFields<'_, '_>,
        next_co: &NextFields<'_, '_>,
    ) -> PyResult<bool> {
        let (Some(ro), Some(co)) = (instance_dict(cur), instance_dict(cur_co)) else {
            return Ok(false);
        };
        if !self.accepts(&ro, &co, next_co)? {
            return Ok(false);
        }
        let py = cur.py();
        for name in &self.concatenated {
            let name = name.bind(py);
            let cur_v = co
                .get_item(name)?
                .unwrap_or_else(|| py.None().into_bound(py));
            co.set_item(name, cur_v.add(next_co.get(name.as_unbound())?)?)?;
        }
        for name in &self.extended {
            let Some(list) = co.get_item(name.bind(py))? else {
                continue; // checked in `accepts`
            };
            let list = list.cast_into::<PyList>()?;
            let more = next_co.get(name)?;
            if more.is_exact_instance_of::<PyList>() {
                let n = list.len();
                list.set_slice(n, n, &more)?;
            } else {
                list.call_method1(s!(py, "extend"), (more,))?;
            }
        }
        Self::assign_each(&co, next_co, &self.kept_unless_none, true)?;
        Self::assign_each(&co, next_co, &self.replaced, false)?;
        for name in &self.ro_or {
            let name = name.bind(py);
            let cur_v = ro
                .get_item(name)?
                .unwrap_or_else(|| py.None().into_bound(py));
            ro.set_item(name, cur_v.bitor(next_ro.get(name.as_unbound())?)?)?;
        }
        Self::assign_each(&ro, next_ro, &self.ro_replaced, false)?;
        Self::assign_each(&ro, next_ro, &self.ro_kept_unless_none, true)?;
        Ok(true)
    }
}

/// `obj.__dict__`, when it is a plain dict.
fn instance_dict<'py>(obj: &Bound<'py, PyAny>) -> Option<Bound<'py, PyDict>> {
    let d = obj.getattr(s!(obj.py(), "__dict__")).ok()?;
    d.cast_into_exact::<PyDict>().ok()
}

impl Classes {
    /// The one completion of a RequestOutput whose `outputs` is a list of one.
    pub(super) fn single_completion<'py>(
        &self,
        ro: &Bound<'py, PyAny>,
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        let outs = ro.getattr(self.fields.outputs.bind(ro.py()))?;
        Ok(match outs.cast_into::<PyList>() {
            Ok(l) if l.len() == 1 => Some(l.get_item(0)?),
            _ => None,
        })
    }

    /// The output a fast request's collector still holds, when the native merge
    /// may take the next one: n = 1 (no parent), an exact RequestOutputCollector
    /// that aggregates (DELTA), holding exactly a RequestOutput with one completion.
    pub(super) fn merge_target<'py>(
        &self,
        py: Python<'py>,
        has_parent: bool,
        queue: Option<&Queue>,
    ) -> PyResult<Option<(Bound<'py, PyAny>, Bound<'py, PyAny>)>> {
        if !self.merge_on || has_parent {
            return Ok(None);
        }
        let Some(q) = queue.filter(|q| q.exact && q.aggregate) else {
            return Ok(None);
        };
        let Some(d) = q.dict.as_ref() else {
            return Ok(None);
        };
        let Some(cur) = d.bind(py).get_item(self.obj.collector_output.bind(py))? else {
            return Ok(None);
        };
        if !cur.get_type().is(self.request_output.bind(py)) {
            return Ok(None);
        }
        Ok(self
            .single_completion(&cur)?
            .filter(|co| co.get_type().is(self.completion_output.bind(py)))
            .map(|co| (cur, co)))
    }
}

#[cfg(test)]
mod tests {
    use super::{SmallList, Template};
    use pyo3::prelude::*;
    use pyo3::types::{IntoPyDict, PyDict};

    fn dict<'py>(py: Python<'py>, items: &[(&str, &Bound<'py, PyAny>)]) -> Bound<'py, PyDict> {
        items.iter().copied().into_py_dict(py).unwrap()
    }

    /// Which dict a split template is based on, and the names of its own values.
    fn based_on(t: &Template, py: Python<'_>) -> (usize, Vec<String>) {
        let own = t.own.iter().map(|(n, _)| n.bind(py).to_string()).collect();
        (t.base.bind(py).as_ptr() as usize, own)
    }

    #[test]
    fn split_shares_only_a_template_with_the_same_keys_in_the_same_order() {
        Python::initialize();
        Python::attach(|py| {
            let (a, b) = (
                py.None().into_bound(py),
                1i64.into_pyobject(py).unwrap().into_any(),
            );
            let c = "c".into_pyobject(py).unwrap().into_any();
            let shared = dict(py, &[("x", &a), ("y", &a)]);
            let shared_at = shared.as_ptr() as usize;
            let split = |full: &Bound<'_, PyDict>| {
                based_on(&Template::split(full.clone(), Some(&shared)), py)
            };

            let same_keys = dict(py, &[("x", &a), ("y", &b)]);
            assert_eq!(split(&same_keys), (shared_at, vec!["y".to_string()]));

            // A key the shared template lacks (one an adapter added) keeps the whole dict:
            // on the shared base that key would be lost.
            let extra_key = dict(py, &[("x", &a), ("y", &a), ("z", &c)]);
            assert_eq!(split(&extra_key), (extra_key.as_ptr() as usize, vec![]));

            let fewer_keys = dict(py, &[("x", &a)]);
            assert_eq!(split(&fewer_keys), (fewer_keys.as_ptr() as usize, vec![]));

            let other_order = dict(py, &[("y", &a), ("x", &a)]);
            assert_eq!(split(&other_order), (other_order.as_ptr() as usize, vec![]));

            let nothing_shared = Template::split(same_keys.clone(), None);
            assert_eq!(
                based_on(&nothing_shared, py),
                (same_keys.as_ptr() as usize, vec![])
            );
        });
    }

    #[test]
    fn small_list_keeps_push_order_past_its_inline_items() {
        for n in 0..6 {
            let mut l: SmallList<usize, 2> = SmallList::new();
            for i in 0..n {
                l.push(i);
            }
            assert_eq!(
                l.iter().copied().collect::<Vec<_>>(),
                (0..n).collect::<Vec<_>>()
            );
            assert_eq!(l.iter().next_back().copied(), n.checked_sub(1));
        }
    }
}
