//! Prefetching the requests a step is about to reach. At big batches each
//! request's table entry and the Python objects its output touches (its
//! collector and event, its statistics, its template values, the ends of its
//! ids and text) are cold. Walking the last step's order (the table's
//! guesses) a few outputs ahead and hinting their lines lets those misses
//! overlap instead of stalling the loop one by one. Only hints: a wrong guess
//! costs the hint, and what the step reads and writes is unchanged.
//!
//! Two stages: the entry first, then (once it is in cache) the objects it
//! points to.

use super::*;
use crate::prefetch;

/// How many outputs ahead of the loop each stage runs.
const ENTRY_AHEAD: usize = 8;
const OBJECTS_AHEAD: usize = 4;
/// The lines of an entry worth prefetching (all of a fast request's).
const ENTRY_LINES: usize = 12;

/// The stages' cursors, walking the guessed order ahead of the step's outputs.
pub(super) struct Ahead {
    entry: usize,
    objects: usize,
}

impl Ahead {
    /// Cursors for a new step, with the first outputs' lines already asked for.
    pub(super) fn start(table: &Table<Req>) -> Self {
        let first = table.first_guess();
        let mut a = Self {
            entry: first,
            objects: first,
        };
        for i in 0..ENTRY_AHEAD {
            a.entry = entry(table, a.entry);
            if i >= ENTRY_AHEAD - OBJECTS_AHEAD {
                a.objects = objects(table, a.objects);
            }
        }
        a
    }

    /// One output further: called before each output's step.
    pub(super) fn advance(&mut self, table: &Table<Req>) {
        self.entry = entry(table, self.entry);
        self.objects = objects(table, self.objects);
    }
}

fn entry(table: &Table<Req>, slot: usize) -> usize {
    table.prefetch_slot(slot, ENTRY_LINES);
    table.guess_after(slot)
}

fn objects(table: &Table<Req>, slot: usize) -> usize {
    if let Some(req) = table.get(slot) {
        request_objects(req);
    }
    table.guess_after(slot)
}

/// The objects a fast request's output touches (a stock-owned one's, fewer).
fn request_objects(req: &Req) {
    object(&req.progress.stats);
    if let Some(q) = &req.queue {
        if let Some(d) = &q.dict {
            object(d);
        }
        if let Some((ev, d)) = &q.ready {
            object(ev);
            object(d);
        }
    }
    if let Mode::Fast(f) = &req.mode {
        f.ro_template.prefetch_own();
        f.co_template.prefetch_own();
        if let Detok::Native(n) = &f.detok {
            n.st.prefetch_tails();
            if let Some(ids) = &n.ids {
                object(ids);
            }
        }
    }
}

/// A Python object's header, and the line before it (its GC header and, for
/// instances, the pointers to their dict).
pub(super) fn object<T>(p: &Py<T>) {
    let p = p.as_ptr().cast::<u8>().cast_const();
    prefetch::line(p);
    prefetch::line(p.wrapping_sub(32));
}
