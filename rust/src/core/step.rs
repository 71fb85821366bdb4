//! The per-step loop: one `EngineCoreOutput` at a time, on the fast path, the
//! Python fallback or the multimodal-miss path; request state kept in sync with
//! vLLM's `RequestState`; finishing and aborting requests.

use super::stats::record_plain_decode;
use super::*;

/// `stock_step`'s answer: (outputs, aborts, ids it finished, what it raised).
type StockStepped<'py> = (
    Bound<'py, PyAny>,
    Bound<'py, PyAny>,
    Vec<String>,
    Option<Bound<'py, PyAny>>,
);

impl OutputCore {
    /// Write the Rust-owned mutable fields back into the stock RequestState.
    /// (A stock-owned request's state is the stock processor's: nothing to write.)
    pub(super) fn sync_state(cls: &Classes, py: Python<'_>, req: &Req) -> PyResult<()> {
        let Mode::Fast(f) = &req.mode else {
            return Ok(());
        };
        let st = req.state.bind(py);
        st.setattr(cls.obj.is_prefilling.bind(py), req.progress.is_prefilling)?;
        st.setattr(
            cls.obj.num_cached_tokens.bind(py),
            req.progress.num_cached_tokens.bind(py),
        )?;
        st.setattr(
            cls.obj.num_cache_creation_tokens.bind(py),
            req.progress.num_cache_creation_tokens.bind(py),
        )?;
        st.setattr(cls.obj.sent_tokens_offset.bind(py), f.sent_offset)?;
        st.setattr(
            cls.obj.spec_decode_metrics.bind(py),
            f.spec_decode_metrics.as_ref().map(|m| m.bind(py).clone()),
        )?;
        let starts = PyList::empty(py);
        for (v, s) in &f.weight_starts {
            starts.append((v.bind(py), *s))?;
        }
        st.setattr(cls.obj.weight_version_starts.bind(py), starts)?;
        Ok(())
    }

    /// A native detokenizer for a new request, or the reason it cannot have one.
    pub(super) fn native_detok(
        &self,
        py: Python<'_>,
        vocab: Arc<Vocab>,
        n: NativeSpec<'_>,
        kind: OutKind,
        stream_interval: usize,
    ) -> PyResult<Result<Native, &'static str>> {
        let prompt = n.prompt_token_ids;
        let mut prompt_ids = Vec::with_capacity(prompt.len().unwrap_or(0));
        for x in prompt.try_iter()? {
            match x?.extract::<u32>() {
                Ok(id) => prompt_ids.push(id),
                Err(_) => return Ok(Err("token_id_out_of_range")),
            }
        }
        let params = DetokParams {
            skip_special_tokens: n.skip_special_tokens,
            spaces_between_special_tokens: n.spaces_between_special_tokens,
            stop: n.stop.unwrap_or_default(),
            include_stop_str_in_output: n.include_stop_str_in_output,
            min_tokens: n.min_tokens,
        };
        if let Err(r) = supports(&params) {
            return Ok(Err(r.label()));
        }
        let ids =
            (kind != OutKind::Delta || stream_interval > 1).then(|| PyList::empty(py).unbind());
        let st = guarded("new", || DetokState::new(vocab, &prompt_ids, params))?;
        Ok(Ok(Native { st, ids }))
    }

    pub(super) fn demote(&mut self, py: Python<'_>, slot: usize, reason: &str) -> PyResult<()> {
        let req = self.table.get_mut(slot).unwrap();
        Self::sync_state(&self.cls, py, req)?;
        self.helpers.adopt(py, req)?;
        req.mode = Mode::Stock;
        self.helpers
            .hand_over
            .bind(py)
            .call1((req.state.bind(py),))?;
        *self.fallbacks.entry(reason.to_owned()).or_default() += 1;
        Ok(())
    }
}

impl Helpers {
    /// Bring the stock detokenizer of a native request up to date (replaying its
    /// ids), so vLLM's Python code can take over; from then on the request
    /// detokenizes with it, so its ids are never replayed twice.
    pub(super) fn adopt(&self, py: Python<'_>, req: &mut Req) -> PyResult<()> {
        if let Mode::Fast(f) = &mut req.mode {
            if let Detok::Native(nd) = &f.detok {
                let ids = PyList::new(py, nd.st.output_token_ids())?;
                let detok = self.adopt_native.bind(py).call1((
                    req.state.bind(py),
                    ids,
                    nd.st.last_output_offset(),
                ))?;
                f.detok = Detok::Python(detok.unbind());
            }
        }
        Ok(())
    }
}

impl OutputCore {
    /// `_finish_request` + stop-string abort + finished stats.
    pub(super) fn finish<'py>(
        &mut self,
        py: Python<'py>,
        id: &str,
        fr_obj: &Bound<'py, PyAny>,
        engine_finished: bool,
        eco: &Bound<'py, PyAny>,
        cx: &Step<'_, 'py>,
    ) -> PyResult<()> {
        let Some(req) = self.table.remove(id) else {
            return Ok(());
        };
        self.forget_parent_if_done(py, &req)?;
        if !engine_finished {
            cx.aborts.append(req.id.bind(py))?;
        }
        let iteration_stats = cx.iteration_stats;
        if !iteration_stats.is_none() {
            Self::sync_state(&self.cls, py, &req)?;
            self.helpers.finished_stats.bind(py).call1((
                self.lora_states.bind(py),
                iteration_stats,
                req.state.bind(py),
                fr_obj,
                eco,
            ))?;
        }
        Ok(())
    }

    /// Abort every live sibling of `parent` (n>1 miss): removed here, listed for
    /// the engine core, no abort output (the parent's answer is the error).
    pub(super) fn abort_siblings<'py>(
        &mut self,
        py: Python<'py>,
        parent: &Bound<'py, PyAny>,
        aborts: &Bound<'py, PyList>,
    ) -> PyResult<()> {
        let children = parent.getattr(self.cls.obj.child_requests.bind(py))?;
        let ids: Vec<String> =
            PyList::new(py, children.try_iter()?.collect::<PyResult<Vec<_>>>()?)?.extract()?;
        for cid in ids {
            let resolved = self.table.resolve_abort(std::slice::from_ref(&cid), true);
            for rid in resolved {
                if let Some(req) = self.table.pop_aborted(&rid) {
                    self.take_back_if_stock(py, &req)?;
                    self.lora_states.bind(py).call_method1(
                        self.cls.obj.request_finished.bind(py),
                        (req.id.bind(py), req.lora_name.bind(py)),
                    )?;
                    aborts.append(req.id.bind(py))?;
                    self.step_sibling_aborts.push(rid);
                }
            }
        }
        children.call_method0(s!(py, "clear"))?;
        let pid: String = parent
            .getattr(self.cls.obj.parent_request_id.bind(py))?
            .extract()?;
        self.parents.remove(&pid);
        Ok(())
    }

    /// The stock processor forgets a request the core answers or aborts itself.
    pub(super) fn take_back_if_stock(&self, py: Python<'_>, req: &Req) -> PyResult<()> {
        if matches!(req.mode, Mode::Stock) {
            self.helpers.take_back.bind(py).call1((req.id.bind(py),))?;
        }
        Ok(())
    }

    /// Take `rid` off `aborts` if this step listed it as an aborted sibling.
    fn unlist_sibling_abort(&mut self, rid: &str, aborts: &Bound<'_, PyList>) -> PyResult<()> {
        let Some(i) = self.step_sibling_aborts.iter().position(|s| s == rid) else {
            return Ok(());
        };
        self.step_sibling_aborts.swap_remove(i);
        for (j, item) in aborts.iter().enumerate() {
            if item
                .cast::<PyString>()
                .is_ok_and(|s| s.to_str().is_ok_and(|s| s == rid))
            {
                return aborts.del_item(j);
            }
        }
        Ok(())
    }

    /// Add every missing hash of the step's outputs to the miss set; the outputs
    /// that carry some.
    pub(super) fn collect_misses<'py>(
        &mut self,
        ecos: &Bound<'py, PyList>,
    ) -> PyResult<Vec<Bound<'py, PyAny>>> {
        let mut with_misses = Vec::new();
        for eco in ecos.iter() {
            let m = self.eco.get(&self.eco.view(&eco), F::MmCacheMissHashes)?;
            if !m.is_none() && m.is_truthy()? {
                for h in m.try_iter()? {
                    let h = h?;
                    let h = h
                        .cast::<PyString>()
                        .map_err(|_| PyTypeError::new_err("mm_cache_miss_hashes must hold str"))?;
                    self.misses.add(h.to_str()?);
                }
                with_misses.push(eco);
            }
        }
        Ok(with_misses)
    }

    pub(super) fn invalidate_misses(&mut self, py: Python<'_>) -> PyResult<()> {
        if self.misses.is_empty() {
            return Ok(());
        }
        let cache = match &self.mm_cache_source {
            None => None,
            Some(src) => {
                let src = src.bind(py);
                // Either the cache itself or an object holding it (the renderer),
                // read now because the renderer may rebuild its cache.
                if src.hasattr(self.cls.obj.invalidate.bind(py))? {
                    Some(src.clone())
                } else {
                    let c = src.getattr(self.cls.obj.mm_processor_cache.bind(py))?;
                    (!c.is_none()).then_some(c)
                }
            }
        };
        if let Some(cache) = cache {
            for h in self.misses.hashes() {
                cache.call_method1(self.cls.obj.invalidate.bind(py), (h.as_str(),))?;
                self.invalidations += 1;
            }
        }
        self.misses.clear();
        Ok(())
    }

    /// `step_one`, recovering from a panic in it: the request of that output, if
    /// still tracked (its terminal output not yet published), is failed, and the
    /// step goes on with the other requests. Raising instead would make AsyncLLM's
    /// output handler fail every request of the engine.
    pub(super) fn step_one_recovering<'py>(
        &mut self,
        py: Python<'py>,
        eco: &Bound<'py, PyAny>,
        cx: &Step<'_, 'py>,
    ) -> PyResult<()> {
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.step_one(py, eco, cx)))
        {
            Ok(r) => r,
            Err(p) => {
                let msg = format!(
                    "internal error in vllm-mmretry's output processor: {}",
                    panic_message(p.as_ref())
                );
                self.fail_request(py, eco, cx, &msg)
            }
        }
    }

    /// Take the request of `eco` out of the table after its step failed: its
    /// (n>1: its parent's) one terminal error output, its siblings aborted, and
    /// its id listed for the engine core to stop.
    fn fail_request<'py>(
        &mut self,
        py: Python<'py>,
        eco: &Bound<'py, PyAny>,
        cx: &Step<'_, 'py>,
        msg: &str,
    ) -> PyResult<()> {
        let rid_obj = self.eco.get(&self.eco.view(eco), F::RequestId)?;
        let rid: String = rid_obj.extract()?;
        let Some(req) = self.table.remove(&rid) else {
            return Ok(()); // finished (terminal output published) before the panic
        };
        self.failed_steps += 1;
        Self::sync_state(&self.cls, py, &req)?;
        self.take_back_if_stock(py, &req)?;
        if let Some(p) = &req.parent {
            let p = p.bind(py);
            p.getattr(self.cls.obj.child_requests.bind(py))?
                .call_method1(s!(py, "discard"), (rid.as_str(),))?;
            self.abort_siblings(py, p, cx.aborts)?;
        }
        self.lora_states.bind(py).call_method1(
            self.cls.obj.request_finished.bind(py),
            (req.id.bind(py), req.lora_name.bind(py)),
        )?;
        cx.aborts.append(req.id.bind(py))?;
        let out = self
            .helpers
            .failed_output
            .bind(py)
            .call1((req.state.bind(py), msg))?;
        self.publish(py, &req, out, cx.outs)?;
        self.forget_parent_if_done(py, &req)
    }

    pub(super) fn step_one<'py>(
        &mut self,
        py: Python<'py>,
        eco: &Bound<'py, PyAny>,
        cx: &Step<'_, 'py>,
    ) -> PyResult<()> {
        let ev = self.eco.view(eco);
        let rid_obj = self.eco.get(&ev, F::RequestId)?;
        let rid = rid_obj
            .cast::<PyString>()
            .map_err(|_| PyTypeError::new_err("EngineCoreOutput.request_id must be a str"))?;
        let Some(rid_s) = tracked_id(rid) else {
            return Ok(());
        };
        let Some(slot) = self.table.step_slot_of(rid_s) else {
            // An output for an already-aborted request; a sibling this step aborted
            // that the engine has finished needs no abort.
            if !self.eco.get(&ev, F::FinishReason)?.is_none() {
                self.unlist_sibling_abort(rid_s, cx.aborts)?;
            }
            return Ok(());
        };

        let fr_obj = self.eco.get(&ev, F::FinishReason)?;
        let finish = self.cls.finish_of(&fr_obj);

        // Per-output features that only vLLM's Python objects implement.
        if matches!(self.table.get(slot).unwrap().mode, Mode::Fast(_)) {
            let reason = if finish == Finish::Foreign {
                Some("finish_reason_type")
            } else if !self
                .eco
                .get(&ev, F::NewTokenIds)?
                .is_exact_instance_of::<PyList>()
            {
                // The decoder always gives a list; an engine of the caller's own
                // may not (None, a tuple), and vLLM's Python answers that its way.
                Some("token_ids_type")
            } else if !self.eco.get(&ev, F::RoutedExperts)?.is_none() {
                Some("routed_experts")
            } else if !self.eco.get(&ev, F::NewSamplingMask)?.is_none() {
                Some("sampling_mask")
            } else if !self.eco.get(&ev, F::NewLogprobs)?.is_none()
                || !self.eco.get(&ev, F::NewPromptLogprobsTensors)?.is_none()
                || !self.eco.get(&ev, F::PromptTokenIdLogprobs)?.is_none()
            {
                Some("unrequested_logprobs")
            } else if !self.eco.get(&ev, F::PoolingOutput)?.is_none() {
                Some("pooling_output")
            } else {
                None
            };
            if let Some(r) = reason {
                self.demote(py, slot, r)?;
            }
        }

        let miss = finish == Finish::Member(self.cls.finish.error) && {
            let m = self.eco.get(&ev, F::MmCacheMissHashes)?;
            !m.is_none() && m.is_truthy()?
        };
        if self.test_panic_on.iter().any(|t| t == rid_s) {
            panic!("forced by {TEST_PANIC_ENV} for request {rid_s}");
        }
        let req = self.table.get(slot).unwrap();
        let miss = miss && !req.is_pooling;
        if matches!(req.mode, Mode::Stock) && !miss {
            self.stock_batch.push(eco.clone().unbind());
            return Ok(());
        }
        // Outputs go out in the engine's order: the stock batch so far first (it
        // may finish requests, so the slot is looked up again).
        let slot = if self.stock_batch.is_empty() {
            slot
        } else {
            self.flush_stock(py, cx)?;
            match self.table.slot_of(rid_s) {
                Some(slot) => slot,
                None => return Ok(()),
            }
        };
        if miss {
            return self.step_miss(py, slot, eco, cx, rid_s, &fr_obj);
        }
        let fr = finish.code(&fr_obj)?;
        self.step_fast(py, slot, &ev, (fr_obj, fr), cx, rid_s)
    }

    /// The waiting outputs of stock-owned requests, through vLLM's own
    /// `process_outputs` in one call; requests it finished leave the table.
    pub(super) fn flush_stock<'py>(&mut self, py: Python<'py>, cx: &Step<'_, 'py>) -> PyResult<()> {
        if self.stock_batch.is_empty() {
            return Ok(());
        }
        let batch = PyList::new(py, self.stock_batch.drain(..))?;
        self.fallback_steps += batch.len() as u64;
        let r = self.helpers.stock_step.bind(py).call1((
            batch,
            cx.ts,
            cx.iteration_stats,
            cx.weight_version,
        ))?;
        let (outs, aborts, gone, error): StockStepped<'py> = r.extract()?;
        // Forget what vLLM's code finished even when it raised after finishing it.
        for rid in gone {
            if let Some(req) = self.table.remove(&rid) {
                self.forget_parent_if_done(py, &req)?;
            }
        }
        if let Some(e) = error {
            return Err(PyErr::from_value(e));
        }
        for o in outs.try_iter()? {
            cx.outs.append(o?)?;
        }
        for a in aborts.try_iter()? {
            cx.aborts.append(a?)?;
        }
        Ok(())
    }

    pub(super) fn step_miss<'py>(
        &mut self,
        py: Python<'py>,
        slot: usize,
        eco: &Bound<'py, PyAny>,
        cx: &Step<'_, 'py>,
        rid: &str,
        fr_obj: &Bound<'py, PyAny>,
    ) -> PyResult<()> {
        let Step {
            ts,
            iteration_stats,
            weight_version,
            outs,
            aborts,
            ..
        } = *cx;
        let req = self.table.get_mut(slot).unwrap();
        Self::sync_state(&self.cls, py, req)?;
        self.helpers.adopt(py, req)?;
        // The error output is built by vLLM-aware Python code (rare path); it
        // also runs the iteration-stats update for this output.
        let out = self.helpers.error_output.bind(py).call1((
            req.state.bind(py),
            eco,
            ts,
            iteration_stats,
            weight_version,
            self.lora_states.bind(py),
        ))?;
        Self::pull_prefill_end(&self.cls, py, self.table.get_mut(slot).unwrap())?;
        let req = self.table.get(slot).unwrap();
        // Only now: had the output failed, the request would stay vLLM's to step.
        self.take_back_if_stock(py, req)?;
        let parent = req.parent.as_ref().map(|p| p.clone_ref(py));
        if let Some(p) = &parent {
            // Take this child out of the parent before aborting its siblings.
            p.bind(py)
                .getattr(self.cls.obj.child_requests.bind(py))?
                .call_method1(s!(py, "discard"), (rid,))?;
        }
        if let Some(p) = &parent {
            self.abort_siblings(py, p.bind(py), aborts)?;
        }
        let req = self.table.get(slot).unwrap();
        self.publish(py, req, out, outs)?;
        self.finish(py, rid, fr_obj, true, eco, cx)?;
        Ok(())
    }

    /// A fast step's iteration statistics: natively for a plain decode step, else
    /// with vLLM's own `update_from_output` (when statistics are on).
    fn record_iteration_stats<'py>(
        &mut self,
        py: Python<'py>,
        slot: usize,
        ev: &Eco<'_, 'py>,
        new_ids: &Bound<'py, PyAny>,
        cx: &Step<'_, 'py>,
    ) -> PyResult<()> {
        let req = self.table.get(slot).unwrap();
        let native = match cx.decode {
            Some(d) if !req.progress.is_prefilling => record_plain_decode(
                d,
                &self.cls.obj,
                &self.eco,
                ev,
                req.progress.stats.bind(py),
                new_ids,
            )?,
            _ => false,
        };
        if native {
            self.native_stats_steps += 1;
        } else if !cx.iteration_stats.is_none() {
            cx.iteration_stats.call_method1(
                self.cls.obj.update_from_output.bind(py),
                (
                    ev.obj(),
                    cx.ts,
                    req.progress.is_prefilling,
                    req.progress.stats.bind(py),
                    self.lora_states.bind(py),
                    req.lora_name.bind(py),
                ),
            )?;
        }
        Ok(())
    }

    /// One output of a fast request; its finish reason comes as (the object, as
    /// vLLM hands it on, and its code, read once by `step_one`).
    pub(super) fn step_fast<'py>(
        &mut self,
        py: Python<'py>,
        slot: usize,
        ev: &Eco<'_, 'py>,
        (mut fr_obj, mut fr): (Bound<'py, PyAny>, Option<i64>),
        cx: &Step<'_, 'py>,
        rid: &str,
    ) -> PyResult<()> {
        let Step {
            weight_version,
            outs,
            ..
        } = *cx;
        self.fast_steps += 1;
        let er = &self.eco;
        let new_ids = er.get(ev, F::NewTokenIds)?;
        let mut stop_reason = er.get(ev, F::StopReason)?;
        let kv = er.get(ev, F::KvTransferParams)?;
        let ec = er.get(ev, F::EcTransferParams)?;
        let spec = er.get(ev, F::SpecDecodeMetrics)?;
        let engine_finished = fr.is_some();
        let prefill_stats = {
            let req = self.table.get(slot).unwrap();
            if req.progress.is_prefilling {
                Some(er.get(ev, F::PrefillStats)?)
            } else {
                None
            }
        };

        // 1) Iteration stats.
        self.record_iteration_stats(py, slot, ev, &new_ids, cx)?;
        let req = self.table.get_mut(slot).unwrap();
        if let Some(ps) = prefill_stats {
            Self::end_prefill(&self.cls, py, req, &ps)?;
        }
        let Mode::Fast(f) = &mut req.mode else {
            unreachable!()
        };
        if !spec.is_none() {
            f.spec_decode_metrics = Some(spec.unbind());
        }
        let n_new = new_ids.len()?;
        if n_new > 0 {
            note_weight_version(f, weight_version)?;
        }

        // 2) Detokenize and check stop strings.
        let stop_terminated = fr == Some(self.cls.finish.stop);
        let (stop, n_now) = Self::detokenize(
            &self.cls,
            f,
            &new_ids,
            n_new,
            stop_terminated,
            &mut self.scratch,
        )?;
        if let Some(stop) = stop {
            fr = Some(self.cls.finish.stop);
            fr_obj = self.cls.finish_objs[self.cls.finish.stop as usize]
                .bind(py)
                .clone();
            stop_reason = stop;
            let kept = n_now.saturating_sub(f.n_out);
            if n_new > kept {
                // Drop tokens past the stop string (vLLM's _trim_surplus_tokens).
                new_ids.del_item(PySlice::new(py, kept as isize, n_new as isize, 1))?;
            }
        }
        f.n_out = n_now;

        // 3) Build and hand over the output.
        let out = {
            let req = self.table.get_mut(slot).unwrap();
            let stop_reason = if fr.is_some() {
                stop_reason
            } else {
                py.None().into_bound(py)
            };
            let step = StepOut {
                new_ids,
                finish: fr,
                stop_reason,
                kv,
                ec,
            };
            self.cls.make_fast_output(py, req, step)?
        };
        let req = self.table.get(slot).unwrap();
        match out {
            Built::Output(out) => self.publish(py, req, out, outs)?,
            Built::Merged => self.native_merges += 1,
            Built::Nothing => {}
        }
        if fr.is_some() {
            self.finish(py, rid, &fr_obj, engine_finished, ev.obj(), cx)?;
        }
        Ok(())
    }

    /// The request's first output after prefill: its cached-token counts from the
    /// engine's prefill statistics (or the remote prefill's), kept in its progress
    /// and in its RequestOutput template.
    fn end_prefill(
        cls: &Classes,
        py: Python<'_>,
        req: &mut Req,
        prefill_stats: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let p = &mut req.progress;
        if !prefill_stats.is_none() {
            p.num_cached_tokens = prefill_stats
                .getattr(cls.obj.num_cached_tokens.bind(py))?
                .unbind();
            p.num_cache_creation_tokens = prefill_stats
                .getattr(cls.obj.num_cache_creation_tokens.bind(py))?
                .unbind();
        }
        if let Some(r) = &p.remote_prefill_cached_tokens {
            p.num_cached_tokens = r.clone_ref(py);
        }
        p.is_prefilling = false;
        if let Mode::Fast(f) = &mut req.mode {
            let t = &mut f.ro_template;
            t.set(
                py,
                &cls.fields.num_cached_tokens,
                p.num_cached_tokens.clone_ref(py),
            );
            t.set(
                py,
                &cls.fields.num_cache_creation_tokens,
                p.num_cache_creation_tokens.clone_ref(py),
            );
        }
        Ok(())
    }

    /// Take the end of prefill the error output's Python code made on the request's
    /// state (its cached-token counts), so that writing the progress back keeps it.
    fn pull_prefill_end(cls: &Classes, py: Python<'_>, req: &mut Req) -> PyResult<()> {
        if !matches!(req.mode, Mode::Fast(_)) || !req.progress.is_prefilling {
            return Ok(());
        }
        let st = req.state.bind(py);
        let p = &mut req.progress;
        p.num_cached_tokens = st.getattr(cls.obj.num_cached_tokens.bind(py))?.unbind();
        p.num_cache_creation_tokens = st
            .getattr(cls.obj.num_cache_creation_tokens.bind(py))?
            .unbind();
        p.is_prefilling = st.getattr(cls.obj.is_prefilling.bind(py))?.is_truthy()?;
        Ok(())
    }

    /// Feed the step's tokens to the request's detokenizer: the stop string it
    /// matched, if any, and the request's output-token count after the step.
    fn detokenize<'py>(
        cls: &Classes,
        f: &mut Fast,
        new_ids: &Bound<'py, PyAny>,
        n_new: usize,
        stop_terminated: bool,
        scratch: &mut DetokScratch,
    ) -> PyResult<(Option<Bound<'py, PyAny>>, usize)> {
        let py = new_ids.py();
        Ok(match &mut f.detok {
            Detok::Python(detok) => {
                let detok = detok.bind(py);
                let stop = detok
                    .call_method1(cls.obj.detok_update.bind(py), (new_ids, stop_terminated))?;
                if stop.is_truthy()? {
                    let n_now: usize = detok
                        .call_method0(cls.obj.detok_num_output_tokens.bind(py))?
                        .extract()?;
                    (Some(stop), n_now)
                } else {
                    (None, f.n_out + n_new)
                }
            }
            Detok::Native(nd) => {
                read_ids(new_ids, &mut scratch.ids)?;
                let st = &mut nd.st;
                let stop = guarded("update", || {
                    st.update(&mut scratch.detok, &scratch.ids, stop_terminated)
                })?
                .map_err(detok_err)?;
                let n_now = nd.st.num_output_tokens();
                if let Some(l) = &nd.ids {
                    let l = l.bind(py);
                    for x in new_ids.try_iter()? {
                        l.append(x?)?;
                    }
                    if l.len() > n_now {
                        l.del_slice(n_now, l.len())?;
                    }
                }
                (stop.map(|s| PyString::new(py, &s).into_any()), n_now)
            }
        })
    }

    /// Drop the parent of a finished or aborted child once it has no child left
    /// (after an abort its last sibling may have finished earlier: stock keeps
    /// such a parent forever).
    pub(super) fn forget_parent_if_done(&mut self, py: Python<'_>, req: &Req) -> PyResult<()> {
        if let Some(parent) = &req.parent {
            let p = parent.bind(py);
            if p.getattr(self.cls.obj.child_requests.bind(py))?.len()? == 0 {
                let pid: String = p
                    .getattr(self.cls.obj.parent_request_id.bind(py))?
                    .extract()?;
                self.parents.remove(&pid);
            }
        }
        Ok(())
    }

    pub(super) fn abort_inner<'py>(
        &mut self,
        py: Python<'py>,
        ids: Vec<String>,
        internal: bool,
        result: &mut Vec<Py<PyString>>,
    ) -> PyResult<()> {
        let resolved = self.table.resolve_abort(&ids, internal);
        for id in resolved {
            if let Some(mut req) = self.table.pop_aborted(&id) {
                result.push(req.id.clone_ref(py));
                if matches!(req.mode, Mode::Stock) {
                    // vLLM's own abort: LoRA bookkeeping and the abort output.
                    self.helpers
                        .stock_abort
                        .bind(py)
                        .call1((req.id.bind(py),))?;
                } else {
                    self.lora_states.bind(py).call_method1(
                        self.cls.obj.request_finished.bind(py),
                        (req.id.bind(py), req.lora_name.bind(py)),
                    )?;
                    if req.queue.is_some() {
                        let none = py.None().into_bound(py);
                        let step = StepOut {
                            new_ids: PyList::empty(py).into_any(),
                            finish: Some(self.cls.finish.abort),
                            stop_reason: none.clone(),
                            kv: none.clone(),
                            ec: none,
                        };
                        let out = self.cls.make_fast_output(py, &mut req, step)?;
                        if let (Built::Output(out), Some(q)) = (out, req.queue.as_ref()) {
                            self.put(py, q, &out)?;
                        }
                    }
                }
                self.forget_parent_if_done(py, &req)?;
            } else if let Some(parent) = self.parents.get(&id).map(|p| p.clone_ref(py)) {
                let children = parent
                    .bind(py)
                    .getattr(self.cls.obj.child_requests.bind(py))?;
                let kids: Vec<String> = children
                    .try_iter()?
                    .map(|c| c?.extract::<String>())
                    .collect::<PyResult<_>>()?;
                if !kids.is_empty() {
                    self.abort_inner(py, kids, true, result)?;
                }
                self.parents.remove(&id);
            }
        }
        Ok(())
    }
}

/// Start a new weight-version span when the step's tokens come from another
/// version than the last span's (vLLM's `weight_version_starts`).
fn note_weight_version(f: &mut Fast, weight_version: &Bound<'_, PyAny>) -> PyResult<()> {
    if weight_version.is_none() {
        return Ok(());
    }
    let changed = match f.weight_starts.last() {
        None => true,
        Some((v, _)) => !v.bind(weight_version.py()).eq(weight_version)?,
    };
    if changed {
        f.weight_starts
            .push((weight_version.clone().unbind(), f.n_out));
    }
    Ok(())
}
