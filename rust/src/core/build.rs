//! Output objects of the fast path (built from vLLM-constructor templates) and
//! their hand-over to the request's collector or the returned list.

use super::*;

/// A new instance of a plain Python class with `dict` as its `__dict__`,
/// without running `__init__` (the fields are exactly those `__init__` sets).
pub(super) fn new_with_dict<'py>(
    cls: &Bound<'py, PyType>,
    dict: Bound<'py, PyDict>,
) -> PyResult<Bound<'py, PyAny>> {
    let py = cls.py();
    // SAFETY: GenericNew allocates an instance of a heap type (tp_alloc), and
    // GenericSetDict installs the dict; both return NULL/-1 with an exception set.
    unsafe {
        let args = PyTuple::empty(py);
        let obj = ffi::PyType_GenericNew(
            cls.as_ptr() as *mut ffi::PyTypeObject,
            args.as_ptr(),
            std::ptr::null_mut(),
        );
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

impl Classes {
    pub(super) fn weight_spans<'py>(
        &self,
        py: Python<'py>,
        f: &Fast,
    ) -> PyResult<Bound<'py, PyAny>> {
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

    /// The step's text from the request's detokenizer (vLLM's or the native one:
    /// `get_next_output_text`), and the request's whole id list where the output
    /// needs it (a cumulative kind, or a stream interval).
    fn next_text<'py>(
        &self,
        py: Python<'py>,
        f: &mut Fast,
        finished: bool,
        delta: bool,
    ) -> PyResult<(Bound<'py, PyAny>, Option<Bound<'py, PyAny>>)> {
        match &mut f.detok {
            Detok::Python(detok) => {
                let detok = detok.bind(py);
                let all = if f.stream_interval > 1 || !delta {
                    Some(detok.getattr(self.obj.detok_output_token_ids.bind(py))?)
                } else {
                    None
                };
                let text = detok.call_method1(
                    self.obj.detok_get_next_output_text.bind(py),
                    (finished, delta),
                )?;
                Ok((text, all))
            }
            Detok::Native(nd) => {
                let st = &mut nd.st;
                let text = guarded("get_next_output_text", || {
                    PyString::new(py, st.output_text_ref(finished, delta)).into_any()
                })?;
                Ok((text, nd.ids.as_ref().map(|l| l.bind(py).clone().into_any())))
            }
        }
    }

    /// vLLM's `RequestState.make_request_output` for a fast request; when the
    /// request's collector still holds an output, merged into it natively where
    /// the merge rules allow (`merge.rs`).
    pub(super) fn make_fast_output<'py>(
        &self,
        py: Python<'py>,
        req: &mut Req,
        step: StepOut<'py>,
    ) -> PyResult<Built<'py>> {
        let StepOut {
            new_ids,
            finish: fr,
            stop_reason,
            kv,
            ec,
        } = step;
        let Mode::Fast(f) = &mut req.mode else {
            unreachable!("fast output for a fallback request")
        };
        let mut finished = fr.is_some();
        if !finished && f.kind == OutKind::FinalOnly {
            return Ok(Built::Nothing);
        }
        let delta = f.kind == OutKind::Delta;
        let mut token_ids = new_ids;
        if f.stream_interval > 1
            && !(finished || f.sent_offset == 0 || f.n_out - f.sent_offset >= f.stream_interval)
        {
            return Ok(Built::Nothing);
        }
        let (text, all_ids) = self.next_text(py, f, finished, delta)?;
        if let Some(all) = all_ids {
            if !delta {
                token_ids = all;
            } else if f.stream_interval > 1 {
                token_ids =
                    all.get_item(PySlice::new(py, f.sent_offset as isize, isize::MAX, 1))?;
                f.sent_offset = f.n_out;
            }
        }
        let mut co = NextFields::new(py, &f.co_template);
        co.set(&self.fields.text, text);
        co.set(&self.fields.token_ids, token_ids);
        if let Some(code) = fr {
            let fs = self
                .finish_strs
                .get(code as usize)
                .ok_or_else(|| PyValueError::new_err(format!("unknown finish_reason {code}")))?;
            co.set(&self.fields.finish_reason, fs.bind(py).clone().into_any());
            co.set(&self.fields.stop_reason, stop_reason);
            if let Some(m) = &f.spec_decode_metrics {
                co.set(&self.fields.spec_decode_metrics, m.bind(py).clone());
            }
            co.set(&self.fields.weight_versions, self.weight_spans(py, f)?);
        }
        // Looked up only for a step that makes an output.
        let mut n1_ro = None;
        if let Some((cur, cur_co)) =
            self.merge_target(py, req.parent.is_some(), req.queue.as_ref())?
        {
            let ro = self.next_ro_fields(py, f, finished, &kv, &ec);
            if self.merge.merge(&cur, &cur_co, &ro, &co)? {
                return Ok(Built::Merged);
            }
            // Refused: n = 1, so `finished` stays the finish reason's and these
            // fields are the new output's too.
            n1_ro = Some(ro);
        }
        let co = new_with_dict(self.completion_output.bind(py), co.into_dict()?)?;
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
                    let r = parent
                        .bind(py)
                        .call_method1(self.obj.get_outputs.bind(py), (req.id.bind(py), co))?;
                    let (outs, fin): (Bound<'py, PyAny>, bool) = r.extract()?;
                    if !outs.is_truthy()? {
                        return Ok(Built::Nothing);
                    }
                    finished = fin;
                    outs
                }
            }
        };
        let mut ro = match n1_ro {
            Some(ro) => ro,
            None => self.next_ro_fields(py, f, finished, &kv, &ec),
        };
        ro.set(&self.fields.outputs, outputs);
        Ok(Built::Output(new_with_dict(
            self.request_output.bind(py),
            ro.into_dict()?,
        )?))
    }

    /// The fields of a fast request's next RequestOutput, but its `outputs`.
    fn next_ro_fields<'a, 'py>(
        &'a self,
        py: Python<'py>,
        f: &'a Fast,
        finished: bool,
        kv: &Bound<'py, PyAny>,
        ec: &Bound<'py, PyAny>,
    ) -> NextFields<'a, 'py> {
        // The template holds finished=False, no transfer params and the current
        // cached-token counts (written when prefill ends).
        let mut ro = NextFields::new(py, &f.ro_template);
        if finished {
            ro.set(
                &self.fields.finished,
                PyBool::new(py, true).to_owned().into_any(),
            );
        }
        if !kv.is_none() {
            ro.set(&self.fields.kv_transfer_params, kv.clone());
        }
        if !ec.is_none() {
            ro.set(&self.fields.ec_transfer_params, ec.clone());
        }
        ro
    }
}

/// What one step brought a fast request, for building its output.
pub(super) struct StepOut<'py> {
    /// The step's token ids (stop-string surplus already dropped).
    pub(super) new_ids: Bound<'py, PyAny>,
    /// The finish-reason code when the request ends this step.
    pub(super) finish: Option<i64>,
    /// vLLM's stop reason; None unless the request ends.
    pub(super) stop_reason: Bound<'py, PyAny>,
    /// The KV and encoder-cache transfer parameters (None when not sent).
    pub(super) kv: Bound<'py, PyAny>,
    pub(super) ec: Bound<'py, PyAny>,
}

/// What `make_fast_output` made of a step.
pub(super) enum Built<'py> {
    /// A new output for the collector (or the returned list).
    Output(Bound<'py, PyAny>),
    /// Merged into the output the collector still held.
    Merged,
    /// No output this step (FINAL_ONLY before the end, stream interval, n > 1).
    Nothing,
}

impl OutputCore {
    pub(super) fn put<'py>(
        &self,
        py: Python<'py>,
        q: &Queue,
        out: &Bound<'py, PyAny>,
    ) -> PyResult<()> {
        let obj = q.obj.bind(py);
        let Some(d) = q.dict.as_ref().filter(|_| q.exact) else {
            obj.call_method1(self.cls.obj.collector_put.bind(py), (out,))?;
            return self.keep_error_in_merged(py, obj, out);
        };
        // RequestOutputCollector.put, inlined for the RequestOutput case.
        let d = d.bind(py);
        let cur = match d.get_item(self.cls.obj.collector_output.bind(py))? {
            Some(c) => c,
            None => obj.getattr(self.cls.obj.collector_output.bind(py))?,
        };
        if cur.is_none() {
            d.set_item(self.cls.obj.collector_output.bind(py), out)?;
            Self::set_ready(&self.cls.obj, py, q, d)?;
        } else if cur.is_instance(self.cls.request_output.bind(py))? {
            cur.call_method1(self.cls.obj.output_add.bind(py), (out, q.aggregate))?;
            // The merged output keeps a terminal error even where RequestOutput.add
            // is not patched (install() patches it for other callers).
            let err = out.getattr(self.cls.fields.error.bind(py))?;
            if !err.is_none() {
                cur.setattr(self.cls.fields.error.bind(py), err)?;
            }
        }
        Ok(())
    }

    /// After the collector's own `put` merged `out` into an output it held: that
    /// output keeps `out`'s terminal error even where `RequestOutput.add` is not
    /// patched (as the inlined put does).
    fn keep_error_in_merged<'py>(
        &self,
        py: Python<'py>,
        collector: &Bound<'py, PyAny>,
        out: &Bound<'py, PyAny>,
    ) -> PyResult<()> {
        let error = self.cls.fields.error.bind(py);
        let Some(err) = out.getattr(error).ok().filter(|e| !e.is_none()) else {
            return Ok(());
        };
        if let Ok(merged) = collector.getattr(self.cls.obj.collector_output.bind(py)) {
            if !merged.is(out) && merged.is_instance(self.cls.request_output.bind(py))? {
                merged.setattr(error, err)?;
            }
        }
        Ok(())
    }

    /// `collector.ready.set()`: with no waiter, `Event.set` only sets `_value`.
    pub(super) fn set_ready(
        obj: &ObjFields,
        py: Python<'_>,
        q: &Queue,
        d: &Bound<'_, PyDict>,
    ) -> PyResult<()> {
        let ready = match d.get_item(obj.collector_ready.bind(py))? {
            Some(r) => r,
            None => q.obj.bind(py).getattr(obj.collector_ready.bind(py))?,
        };
        if let Some((ev, evd)) = &q.ready {
            if ready.is(ev) {
                let evd = evd.bind(py);
                if let (Some(v), Some(w)) = (
                    evd.get_item(s!(py, "_value"))?,
                    evd.get_item(s!(py, "_waiters"))?,
                ) {
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

    pub(super) fn publish<'py>(
        &self,
        py: Python<'py>,
        req: &Req,
        out: Bound<'py, PyAny>,
        list: &Bound<'py, PyList>,
    ) -> PyResult<()> {
        match &req.queue {
            Some(q) => self.put(py, q, &out),
            None => list.append(out),
        }
    }
}
