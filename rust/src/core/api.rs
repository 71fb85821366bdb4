//! The Python-facing API of `OutputCore` (`vllm_mmretry._core.OutputCore`); every
//! entry point runs under `api()`, so a panic is a RuntimeError, never a PanicException.

use super::stats::{record_plain_decode, DecodeStats};
use super::*;

#[pymethods]
impl OutputCore {
    /// `spec`: a `vllm_adapter.base.CoreSpec` built by the adapter of the running vLLM.
    #[new]
    fn new(py: Python<'_>, spec: CoreSpec<'_>) -> PyResult<Self> {
        api("new", || {
            let finish = FinishCodes {
                stop: spec.finish_stop,
                abort: spec.finish_abort,
                error: spec.finish_error,
            };
            let n_codes = spec.finish_reasons.len() as i64;
            if [finish.stop, finish.abort, finish.error]
                .iter()
                .any(|c| !(0..n_codes).contains(c))
            {
                return Err(PyValueError::new_err(
                    "CoreSpec: finish codes must index finish_reasons",
                ));
            }
            let mut finish_strs = Vec::new();
            for v in &spec.finish_reasons {
                finish_strs.push(v.str()?.unbind());
            }
            let h = spec.helpers;
            Ok(Self {
                table: Table::default(),
                parents: FxMap::default(),
                eco: EcoReader::new(
                    py,
                    &spec.engine_core_output,
                    &spec.eco_fields,
                    spec.eco_offsets,
                )?,
                cls: Classes {
                    request_output: spec.request_output.unbind(),
                    completion_output: spec.completion_output.unbind(),
                    collector: spec.collector.unbind(),
                    weight_span: spec.weight_span.unbind(),
                    event: spec.event.unbind(),
                    finish_strs,
                    finish_objs: spec.finish_reasons.into_iter().map(Bound::unbind).collect(),
                    finish,
                    fields: OutFields::new(py, &spec.output_fields),
                    obj: ObjFields::new(py, &spec.object_fields),
                    merge: MergeRules::new(py, &spec.merge_fields),
                    merge_on: false,
                },
                helpers: Helpers {
                    stock_step: callable("stock_step", h.stock_step)?,
                    stock_abort: callable("stock_abort", h.stock_abort)?,
                    hand_over: callable("hand_over", h.hand_over)?,
                    take_back: callable("take_back", h.take_back)?,
                    error_output: callable("error_output", h.error_output)?,
                    finished_stats: callable("finished_stats", h.finished_stats)?,
                    adopt_native: callable("adopt_native", h.adopt_native)?,
                    failed_output: callable("failed_output", h.failed_output)?,
                },
                lora_states: spec.lora_states.unbind(),
                mm_cache_source: None,
                misses: MissSet::default(),
                fallbacks: BTreeMap::new(),
                fast_steps: 0,
                native_stats: false,
                native_stats_steps: 0,
                native_merges: 0,
                fallback_steps: 0,
                invalidations: 0,
                vocab: None,
                native_requests: 0,
                python_detok: BTreeMap::new(),
                scratch: DetokScratch::default(),
                test_panic_on: test_panic_ids(),
                failed_steps: 0,
                step_sibling_aborts: Vec::new(),
                stock_batch: Vec::new(),
            })
        })
    }

    /// True when EngineCoreOutput fields are read by slot offset.
    #[getter]
    fn fast_field_reads(&self) -> PyResult<bool> {
        api("fast_field_reads", || Ok(self.eco.fast()))
    }

    /// The native vocabulary fast requests detokenize with (None: vLLM's Python
    /// detokenizer). Applies to requests added afterwards.
    #[setter]
    fn set_native_vocab(&mut self, vocab: Option<Bound<'_, PyVocab>>) -> PyResult<()> {
        api("set_native_vocab", || {
            self.vocab = vocab.map(|v| v.get().inner.clone());
            Ok(())
        })
    }
    #[getter]
    fn get_has_native_vocab(&self) -> PyResult<bool> {
        api("get_has_native_vocab", || Ok(self.vocab.is_some()))
    }

    /// Whether a tracked request detokenizes natively.
    fn is_native(&self, request_id: &str) -> PyResult<bool> {
        api("is_native", || {
            let r = self
                .table
                .by_id(request_id)
                .ok_or_else(|| PyKeyError::new_err(request_id.to_owned()))?;
            Ok(matches!(&r.mode, Mode::Fast(f) if matches!(f.detok, Detok::Native(_))))
        })
    }

    /// P0's sender cache (has `invalidate`) or an object whose
    /// `mm_processor_cache` attribute holds it (the renderer); None to disable.
    #[setter]
    fn set_mm_cache_source(&mut self, src: Option<Py<PyAny>>) -> PyResult<()> {
        api("set_mm_cache_source", || {
            self.mm_cache_source = src;
            Ok(())
        })
    }
    #[getter]
    fn get_mm_cache_source(&self, py: Python<'_>) -> PyResult<Option<Py<PyAny>>> {
        api("get_mm_cache_source", || {
            Ok(self.mm_cache_source.as_ref().map(|s| s.clone_ref(py)))
        })
    }

    /// Track a new request (`vllm_adapter.base.NewRequest`).
    fn add(&mut self, py: Python<'_>, request: NewRequest<'_>) -> PyResult<()> {
        api("add", || {
            let NewRequest {
                request_id,
                external_req_id,
                state,
                parent,
                queue,
                fast,
                fallback_reason,
                streaming,
                is_pooling,
            } = request;
            let id = request_id.to_str()?;
            let external = external_req_id.to_str()?;
            if self.table.contains(id) {
                return Err(PyValueError::new_err(format!(
                    "request {id:?} is already tracked by the output processor"
                )));
            }
            let queue = match &queue {
                None => None,
                Some(q) => Some(self.queue_for(py, q, fast.is_some())?),
            };
            let mode = self.mode_for(py, fast, fallback_reason)?;
            let progress = self.progress_of(py, &state, &mode)?;
            let o = &self.cls.obj;
            let req = Req {
                id: request_id.clone().unbind(),
                lora_name: state.getattr(o.lora_name.bind(py))?.unbind(),
                state: state.unbind(),
                siblings: match &parent {
                    Some(p) => Some(p.getattr(o.child_requests.bind(py))?.unbind()),
                    None => None,
                },
                parent: parent.as_ref().map(|p| p.clone().unbind()),
                queue,
                progress,
                streaming,
                is_pooling,
                mode,
            };
            if let Some(p) = parent {
                let pid: String = p.getattr(o.parent_request_id.bind(py))?.extract()?;
                self.parents.insert(pid, p.unbind());
            }
            self.table
                .insert(id, external, req)
                .map_err(|e| PyValueError::new_err(e.to_string()))?;
            Ok(())
        })
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
        api(
            "process_outputs",
            move || -> PyResult<(Bound<'py, PyList>, Bound<'py, PyList>)> {
                let ecos = match engine_core_outputs.cast::<PyList>() {
                    Ok(l) => l.clone(),
                    Err(_) => PyList::new(
                        py,
                        engine_core_outputs
                            .try_iter()
                            .map_err(|_| {
                                PyTypeError::new_err(
                                    "engine_core_outputs must be a list of EngineCoreOutput",
                                )
                            })?
                            .collect::<PyResult<Vec<_>>>()?,
                    )?,
                };
                let none = py.None().into_bound(py);
                let ts = engine_core_timestamp.unwrap_or_else(|| none.clone());
                let its = iteration_stats.unwrap_or_else(|| none.clone());
                let wv = weight_version.unwrap_or_else(|| none.clone());
                let outs = PyList::empty(py);
                let aborts = PyList::empty(py);

                // Pre-pass: every missing hash of this step is invalidated in P0's sender
                // cache, once, before any output of the step is published.
                let with_misses = match self.collect_misses(&ecos) {
                    Ok(w) => w,
                    Err(e) => {
                        self.misses.clear(); // not to be invalidated by a later step
                        return Err(e);
                    }
                };
                self.invalidate_misses(py)?;

                let decode = if self.native_stats && !its.is_none() {
                    DecodeStats::for_step(&self.cls.obj, &ts, &its)?
                } else {
                    None
                };
                let cx = Step {
                    ts: &ts,
                    iteration_stats: &its,
                    weight_version: &wv,
                    outs: &outs,
                    aborts: &aborts,
                    decode: decode.as_ref(),
                };
                self.step_sibling_aborts.clear();
                self.stock_batch.clear();
                self.table.start_step();
                let result = (|| {
                    let mut ahead = ahead::Ahead::start(&self.table);
                    for eco in ecos.iter() {
                        ahead.advance(&self.table);
                        self.step_one_recovering(py, &eco, &cx)?;
                    }
                    self.flush_stock(py, &cx)
                })();
                // vLLM's code raises at the failing output having processed the ones
                // before it: so do the stock-owned outputs still waiting here.
                let result = match result {
                    Err(e) if !self.stock_batch.is_empty() => {
                        Err(self.flush_stock(py, &cx).err().unwrap_or(e))
                    }
                    r => r,
                };
                self.step_sibling_aborts.clear();
                self.stock_batch.clear();
                let flushed = match &decode {
                    Some(d) => d.flush(&self.cls.obj, &its),
                    None => Ok(()),
                };
                // The hashes are consumed: stock AsyncLLM/LLMEngine walk the same outputs
                // after process_outputs and would invalidate them a second time. Clearing
                // the field (instead of patching those loops) keeps that code stock.
                for eco in with_misses {
                    eco.setattr(self.eco.name(py, F::MmCacheMissHashes), &none)?;
                }
                result?;
                flushed?;
                Ok((outs, aborts))
            },
        )
    }

    /// vLLM's `abort_requests`: returns the internal ids to abort in the engine.
    fn abort<'py>(
        &mut self,
        py: Python<'py>,
        request_ids: &Bound<'py, PyAny>,
        internal: bool,
    ) -> PyResult<Vec<Py<PyString>>> {
        api("abort", || {
            if request_ids.is_instance_of::<PyString>() {
                return Err(PyTypeError::new_err(
                    "request_ids must be an iterable of str, not a str",
                ));
            }
            let mut ids = Vec::new();
            for x in request_ids
                .try_iter()
                .map_err(|_| PyTypeError::new_err("request_ids must be an iterable of str"))?
            {
                let x = x?;
                let id = x
                    .cast::<PyString>()
                    .map_err(|_| PyTypeError::new_err("request ids must be str"))?;
                if let Some(id) = tracked_id(id) {
                    ids.push(id.to_owned());
                }
            }
            let mut result = Vec::new();
            self.abort_inner(py, ids, internal, &mut result)?;
            Ok(result)
        })
    }

    /// Drop a finished request (used by streaming-input bookkeeping in Python).
    fn finish_request(&mut self, py: Python<'_>, request_id: &str) -> PyResult<()> {
        api("finish_request", || {
            let req = self
                .table
                .remove(request_id)
                .ok_or_else(|| PyKeyError::new_err(request_id.to_owned()))?;
            self.take_back_if_stock(py, &req)?;
            self.forget_parent_if_done(py, &req)
        })
    }

    fn has(&self, request_id: &Bound<'_, PyString>) -> PyResult<bool> {
        api("has", || {
            Ok(tracked_id(request_id).is_some_and(|id| self.table.contains(id)))
        })
    }
    fn __len__(&self) -> PyResult<usize> {
        api("__len__", || Ok(self.table.len()))
    }
    fn is_streaming(&self, request_id: &str) -> PyResult<bool> {
        api("is_streaming", || {
            self.table
                .by_id(request_id)
                .map(|r| r.streaming)
                .ok_or_else(|| PyKeyError::new_err(request_id.to_owned()))
        })
    }

    /// The stock RequestState of a request, its fields brought up to date.
    fn state(&self, py: Python<'_>, request_id: &str) -> PyResult<Py<PyAny>> {
        api("state", || {
            let req = self
                .table
                .by_id(request_id)
                .ok_or_else(|| PyKeyError::new_err(request_id.to_owned()))?;
            Self::sync_state(&self.cls, py, req)?;
            Ok(req.state.clone_ref(py))
        })
    }
    /// {internal id: RequestState}, synced.
    fn states<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        api("states", || {
            let d = PyDict::new(py);
            for id in self.table.ids() {
                let req = self.table.by_id(id).unwrap();
                Self::sync_state(&self.cls, py, req)?;
                d.set_item(req.id.bind(py), req.state.bind(py))?;
            }
            Ok(d)
        })
    }
    fn parents<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        api("parents", || {
            let d = PyDict::new(py);
            for (k, v) in &self.parents {
                d.set_item(k, v.bind(py))?;
            }
            Ok(d)
        })
    }
    fn external_ids(&self, external_req_id: &str) -> PyResult<Vec<String>> {
        api("external_ids", || {
            Ok(self
                .table
                .external_ids(external_req_id)
                .cloned()
                .unwrap_or_default())
        })
    }
    /// Collectors of all live requests (for propagate_error); None for LLMEngine mode.
    fn queues<'py>(&self, py: Python<'py>) -> PyResult<Vec<Option<Py<PyAny>>>> {
        api("queues", || {
            Ok(self
                .table
                .values()
                .map(|r| r.queue.as_ref().map(|q| q.obj.clone_ref(py)))
                .collect())
        })
    }
    fn num_queued_tokens(&self, py: Python<'_>) -> PyResult<usize> {
        api("num_queued_tokens", || {
            let mut total = 0;
            for r in self.table.values() {
                match r.mode {
                    Mode::Fast(_) => {
                        if r.progress.is_prefilling {
                            total += r.progress.prompt_len;
                        }
                    }
                    Mode::Stock => {
                        let st = r.state.bind(py);
                        if st
                            .getattr(self.cls.obj.is_prefilling.bind(py))?
                            .extract::<bool>()?
                        {
                            total += st
                                .getattr(self.cls.obj.prompt_len.bind(py))?
                                .extract::<usize>()?;
                        }
                    }
                }
            }
            Ok(total)
        })
    }
    /// {"fast_steps", "fallback_steps", "invalidations", "fallbacks": {reason: n}}.
    fn counters<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        api("counters", || {
            let d = PyDict::new(py);
            d.set_item("fast_steps", self.fast_steps)?;
            d.set_item("fallback_steps", self.fallback_steps)?;
            d.set_item("invalidations", self.invalidations)?;
            d.set_item("native_stats_steps", self.native_stats_steps)?;
            d.set_item("native_merges", self.native_merges)?;
            d.set_item("failed_steps", self.failed_steps)?;
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
        })
    }
    /// The native statistics of one plain decode output, on the given stats
    /// objects (the adapter's self-check compares them with vLLM's
    /// `update_from_output`): whether the native rule applied.
    fn native_decode_stats<'py>(
        &self,
        eco: &Bound<'py, PyAny>,
        ts: &Bound<'py, PyAny>,
        req_stats: &Bound<'py, PyAny>,
        iteration_stats: &Bound<'py, PyAny>,
    ) -> PyResult<bool> {
        api("native_decode_stats", || {
            let Some(d) = DecodeStats::for_step(&self.cls.obj, ts, iteration_stats)? else {
                return Ok(false);
            };
            let ev = self.eco.view(eco);
            let new_ids = self.eco.get(&ev, F::NewTokenIds)?;
            let done = record_plain_decode(&d, &self.cls.obj, &self.eco, &ev, req_stats, &new_ids)?;
            d.flush(&self.cls.obj, iteration_stats)?;
            Ok(done)
        })
    }

    /// Whether outputs are merged natively into the one a collector still holds
    /// (set after the adapter's `check_native_merge`).
    #[getter]
    fn get_native_merge(&self) -> PyResult<bool> {
        api("get_native_merge", || Ok(self.cls.merge_on))
    }
    #[setter]
    fn set_native_merge(&mut self, on: bool) -> PyResult<()> {
        api("set_native_merge", || {
            self.cls.merge_on = on;
            Ok(())
        })
    }

    /// The native merge of `next` into `cur` (two RequestOutputs with one
    /// completion each), as the loop does it, for the adapter's self-check:
    /// whether it applied (false: left to vLLM's `add`, nothing written).
    fn native_merge_outputs<'py>(
        &self,
        cur: &Bound<'py, PyAny>,
        next: &Bound<'py, PyAny>,
    ) -> PyResult<bool> {
        api("native_merge_outputs", || {
            let py = cur.py();
            let one = |ro| self.cls.single_completion(ro);
            let (Some(cur_co), Some(next_co)) = (one(cur)?, one(next)?) else {
                return Ok(false);
            };
            let dict = |o: &Bound<'py, PyAny>| -> PyResult<Bound<'py, PyDict>> {
                Ok(o.getattr(s!(py, "__dict__"))?.cast_into::<PyDict>()?)
            };
            let next = Template::whole(dict(next)?);
            let next_co = Template::whole(dict(&next_co)?);
            self.cls.merge.merge(
                cur,
                &cur_co,
                &NextFields::new(py, &next),
                &NextFields::new(py, &next_co),
            )
        })
    }

    fn is_fast(&self, request_id: &str) -> PyResult<bool> {
        api("is_fast", || {
            self.table
                .by_id(request_id)
                .map(|r| matches!(r.mode, Mode::Fast(_)))
                .ok_or_else(|| PyKeyError::new_err(request_id.to_owned()))
        })
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

/// The parts of a new request the core keeps.
impl OutputCore {
    /// The request's collector as the core puts outputs into it.
    fn queue_for(&self, py: Python<'_>, q: &Bound<'_, PyAny>, fast: bool) -> PyResult<Queue> {
        // Only fast requests' outputs are put inline; the others go
        // through the collector's own `put`.
        let exact = fast && q.get_type().is(self.cls.collector.bind(py));
        let dict = if exact {
            q.getattr("__dict__")?.cast_into::<PyDict>().ok()
        } else {
            None
        };
        let ready = match &dict {
            Some(_) => {
                let r = q.getattr(self.cls.obj.collector_ready.bind(py))?;
                if r.get_type().is(self.cls.event.bind(py)) {
                    r.getattr("__dict__")?
                        .cast_into::<PyDict>()
                        .ok()
                        .map(|d| (r.unbind(), d.unbind()))
                } else {
                    None
                }
            }
            None => None,
        };
        Ok(Queue {
            obj: q.clone().unbind(),
            exact,
            aggregate: if exact {
                q.getattr(self.cls.obj.collector_aggregate.bind(py))?
                    .extract()?
            } else {
                false
            },
            dict: dict.map(|d| d.unbind()),
            ready,
        })
    }

    /// Fast (with its detokenizer, native when it can be) or vLLM's per-request
    /// step; counts why a request is not fast or not natively detokenized.
    fn mode_for(
        &mut self,
        py: Python<'_>,
        fast: Option<FastSpec<'_>>,
        fallback_reason: Option<String>,
    ) -> PyResult<Mode> {
        Ok(match fast {
            None => {
                *self
                    .fallbacks
                    .entry(fallback_reason.unwrap_or_else(|| "unspecified".to_owned()))
                    .or_default() += 1;
                Mode::Stock
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
                    (Some(n), Some(vocab)) => {
                        match self.native_detok(py, vocab.clone(), n, kind, stream_interval)? {
                            Ok(nd) => {
                                self.native_requests += 1;
                                Detok::Native(nd)
                            }
                            Err(reason) => {
                                *self.python_detok.entry(reason.to_owned()).or_default() += 1;
                                Detok::Python(d.detokenizer.unbind())
                            }
                        }
                    }
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
                Mode::Fast(Fast {
                    detok,
                    kind,
                    stream_interval,
                    sent_offset: 0,
                    n_out: d.num_output_tokens,
                    ro_template: Template::split(d.ro_template, d.ro_shared.as_ref()),
                    co_template: Template::split(d.co_template, d.co_shared.as_ref()),
                    spec_decode_metrics: None,
                    weight_starts: Vec::new(),
                })
            }
        })
    }

    /// The request's progress as the core keeps it (a fast request's only).
    fn progress_of(
        &self,
        py: Python<'_>,
        state: &Bound<'_, PyAny>,
        mode: &Mode,
    ) -> PyResult<Progress> {
        let o = &self.cls.obj;
        let get = |name: &Py<PyString>| state.getattr(name.bind(py));
        // A stock-owned request's progress is the stock processor's to keep.
        Ok(match mode {
            Mode::Fast(_) => {
                let remote = get(&o.remote_prefill_cached_tokens)?;
                Progress {
                    stats: get(&o.stats)?.unbind(),
                    prompt_len: get(&o.prompt_len)?.extract()?,
                    is_prefilling: get(&o.is_prefilling)?.extract()?,
                    num_cached_tokens: get(&o.num_cached_tokens)?.unbind(),
                    num_cache_creation_tokens: get(&o.num_cache_creation_tokens)?.unbind(),
                    remote_prefill_cached_tokens: (!remote.is_none()).then(|| remote.unbind()),
                }
            }
            Mode::Stock => Progress {
                stats: py.None(),
                prompt_len: 0,
                is_prefilling: false,
                num_cached_tokens: py.None(),
                num_cache_creation_tokens: py.None(),
                remote_prefill_cached_tokens: None,
            },
        })
    }
}
