//! Pure-Rust bookkeeping for the output loop: the request table (internal id ->
//! state, external id -> internal ids) and the per-step set of multimodal hashes
//! to invalidate. No Python here, so it is unit-tested with plain `cargo test`.

use std::collections::hash_map::RandomState;
use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasherDefault, Hasher};

use crate::inline::InlineStr;
use crate::prefetch;

/// Request ids are client-chosen (a body field or `X-Request-Id`), so every map
/// keyed by them uses std's keyed SipHash-1-3 with per-process random keys: ids
/// cannot be built to collide without knowing the keys (no hash flooding).
pub type IdBuild = RandomState;
pub type IdMap<K, V> = HashMap<K, V, IdBuild>;
/// Former name of `IdMap`, kept so code that still says `FxMap` gets the keyed
/// hash too. Not FxHash any more.
pub type FxMap<K, V> = IdMap<K, V>;

/// FxHash (rustc's hasher), the table's hash before ids were treated as hostile.
/// Kept only to show, in tests and benches, the flood that the keyed hash stops:
/// `flood_ids` builds ids that all collide under it.
#[derive(Default, Clone, Copy)]
pub struct FxHasher(u64);

const FX_K: u64 = 0xf135_7aea_2e62_a9c5;

impl Hasher for FxHasher {
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        let mut h = self.0;
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            let v = u64::from_le_bytes(c.try_into().unwrap());
            h = (h.rotate_left(5) ^ v).wrapping_mul(FX_K);
        }
        for &b in chunks.remainder() {
            h = (h.rotate_left(5) ^ b as u64).wrapping_mul(FX_K);
        }
        self.0 = h;
    }
    #[inline]
    fn write_u8(&mut self, i: u8) {
        self.write(&[i]);
    }
    #[inline]
    fn finish(&self) -> u64 {
        self.0
    }
}

pub type FxBuild = BuildHasherDefault<FxHasher>;

/// `n` distinct 16-byte ASCII ids whose FxHash is the same 64-bit value: for a
/// first half `a`, the second half `b = rotl(a * K, 5) ^ c` makes the state after
/// both words `c * K` whatever `a` is. Halves are scanned from a counter and kept
/// when `b` is ASCII (about 1 in 256), so the ids are valid request-id strings.
pub fn flood_ids(n: usize) -> Vec<String> {
    const C: u64 = 0x2d2d_2d2d_2d2d_2d2d; // "--------"
    let mut out = Vec::with_capacity(n);
    let mut counter: u64 = 0;
    while out.len() < n {
        let first = format!("{counter:08x}");
        counter += 1;
        let a = u64::from_le_bytes(first.as_bytes().try_into().unwrap());
        let b = a.wrapping_mul(FX_K).rotate_left(5) ^ C;
        let second = b.to_le_bytes();
        if second.iter().all(|x| x.is_ascii()) {
            out.push(first + std::str::from_utf8(&second).unwrap());
        }
    }
    out
}

#[derive(Debug, PartialEq, Eq)]
pub enum TableError {
    Duplicate(String),
}

impl std::fmt::Display for TableError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TableError::Duplicate(id) => write!(f, "request {id:?} is already tracked"),
        }
    }
}

/// Bytes of an id kept in the map's bucket itself. vLLM's ids (a prefix, a
/// 32-hex uuid and an 8-hex suffix, about 50 bytes) fit; longer ones go to the heap.
const INLINE_ID: usize = 62;

/// A request id as the table's key: looking up a short id compares it with
/// bytes in the bucket, not with a separately allocated string, which is one
/// cold cache line less per request-step at big batches. Hashes and compares
/// as the `str` it holds, so the map is looked up by `&str`.
#[derive(Clone)]
pub struct IdKey(InlineStr<INLINE_ID>);

impl IdKey {
    pub fn new(id: &str) -> Self {
        Self(InlineStr::new(id))
    }

    pub fn as_str(&self) -> &str {
        self.0.as_str()
    }
}

impl std::borrow::Borrow<str> for IdKey {
    fn borrow(&self) -> &str {
        self.as_str()
    }
}

impl PartialEq for IdKey {
    fn eq(&self, other: &Self) -> bool {
        self.as_str() == other.as_str()
    }
}

impl Eq for IdKey {}

impl std::hash::Hash for IdKey {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.as_str().hash(state)
    }
}

struct Entry<T> {
    /// The id again, beside the state: a guessed slot is checked against it.
    id: IdKey,
    external: String,
    value: T,
}

/// No slot: before a step's first output, or no guess.
const NO_SLOT: usize = usize::MAX;

/// Internal id -> state, in slots so the hot loop indexes a Vec; plus the
/// external -> [internal...] map (insertion ordered, as vLLM keeps it).
pub struct Table<T> {
    by_id: IdMap<IdKey, usize>,
    slots: Vec<Option<Entry<T>>>,
    /// By slot: the slot whose output followed this one's in the last step
    /// (`NO_SLOT`: none). Apart from the entries so the loop can walk the order
    /// ahead of its lookups without touching them.
    links: Vec<usize>,
    free: Vec<usize>,
    external: IdMap<String, Vec<String>>,
    /// The slot of the last step's first output, and of the previous output
    /// looked up in this step (`step_slot_of`).
    first: usize,
    cursor: usize,
}

impl<T> Default for Table<T> {
    fn default() -> Self {
        Self {
            by_id: IdMap::default(),
            slots: Vec::new(),
            links: Vec::new(),
            free: Vec::new(),
            external: IdMap::default(),
            first: NO_SLOT,
            cursor: NO_SLOT,
        }
    }
}

impl<T> Table<T> {
    pub fn len(&self) -> usize {
        self.by_id.len()
    }
    pub fn is_empty(&self) -> bool {
        self.by_id.is_empty()
    }
    pub fn contains(&self, id: &str) -> bool {
        self.by_id.contains_key(id)
    }
    pub fn slot_of(&self, id: &str) -> Option<usize> {
        self.by_id.get(id).copied()
    }
    /// A step's outputs start: `step_slot_of` guesses from the last step's order.
    pub fn start_step(&mut self) {
        self.cursor = NO_SLOT;
    }

    /// `slot_of` for the step's outputs in their order. The engine sends a step's
    /// outputs in about the order of the last step's, so the slot that followed
    /// the previous output's last time is tried first, checked against the id
    /// kept in that slot: no hashing and no cold map bucket when it is right,
    /// the map when it is not.
    pub fn step_slot_of(&mut self, id: &str) -> Option<usize> {
        let guess = match self.cursor {
            NO_SLOT => self.first,
            prev => self.guess_after(prev),
        };
        let found = match self.slots.get(guess) {
            Some(Some(e)) if e.id.as_str() == id => guess,
            _ => self.slot_of(id)?,
        };
        match self.cursor {
            NO_SLOT => self.first = found,
            prev => self.links[prev] = found,
        }
        self.cursor = found;
        Some(found)
    }

    /// The slot guessed for a step's first output: the last step's first.
    pub fn first_guess(&self) -> usize {
        self.first
    }

    /// The slot guessed to come after `slot` in this step: what `step_slot_of`
    /// tries first, and what the loop prefetches ahead of it. `NO_SLOT` when
    /// there is no guess (also after `NO_SLOT`).
    pub fn guess_after(&self, slot: usize) -> usize {
        self.links.get(slot).copied().unwrap_or(NO_SLOT)
    }

    /// Prefetch the first `max_lines` cache lines of a slot's entry (nothing
    /// for a slot out of range).
    pub fn prefetch_slot(&self, slot: usize, max_lines: usize) {
        if let Some(e) = self.slots.get(slot) {
            prefetch::lines(e, std::mem::size_of_val(e), max_lines);
        }
    }

    pub fn get(&self, slot: usize) -> Option<&T> {
        self.slots.get(slot)?.as_ref().map(|e| &e.value)
    }
    pub fn get_mut(&mut self, slot: usize) -> Option<&mut T> {
        self.slots.get_mut(slot)?.as_mut().map(|e| &mut e.value)
    }
    pub fn by_id(&self, id: &str) -> Option<&T> {
        self.get(self.slot_of(id)?)
    }
    pub fn ids(&self) -> impl Iterator<Item = &str> {
        self.by_id.keys().map(IdKey::as_str)
    }
    pub fn values(&self) -> impl Iterator<Item = &T> {
        self.slots
            .iter()
            .filter_map(|e| e.as_ref().map(|e| &e.value))
    }
    pub fn external_ids(&self, external: &str) -> Option<&Vec<String>> {
        self.external.get(external)
    }

    pub fn insert(&mut self, id: &str, external: &str, value: T) -> Result<usize, TableError> {
        if self.by_id.contains_key(id) {
            return Err(TableError::Duplicate(id.to_owned()));
        }
        let entry = Entry {
            id: IdKey::new(id),
            external: external.to_owned(),
            value,
        };
        let slot = match self.free.pop() {
            Some(s) => {
                self.slots[s] = Some(entry);
                self.links[s] = NO_SLOT;
                s
            }
            None => {
                self.slots.push(Some(entry));
                self.links.push(NO_SLOT);
                self.slots.len() - 1
            }
        };
        self.by_id.insert(IdKey::new(id), slot);
        self.external
            .entry(external.to_owned())
            .or_default()
            .push(id.to_owned());
        Ok(slot)
    }

    fn unlink_external(&mut self, external: &str, id: &str) {
        if let Some(ids) = self.external.get_mut(external) {
            if let Some(pos) = ids.iter().position(|x| x == id) {
                ids.remove(pos);
            }
            if ids.is_empty() {
                self.external.remove(external);
            }
        }
    }

    /// A request finished: drop it from both maps.
    pub fn remove(&mut self, id: &str) -> Option<T> {
        let slot = self.by_id.remove(id)?;
        let entry = self.slots[slot].take().expect("slot of a live id");
        self.free.push(slot);
        self.unlink_external(&entry.external, id);
        Some(entry.value)
    }

    /// Drop only the state (the external mapping was already consumed by an abort).
    fn take_state(&mut self, id: &str) -> Option<T> {
        let slot = self.by_id.remove(id)?;
        let entry = self.slots[slot].take().expect("slot of a live id");
        self.free.push(slot);
        Some(entry.value)
    }

    /// Step 1 of vLLM's `abort_requests`: turn the given ids into internal ids,
    /// consuming the external mapping. Internal ids that are not live requests
    /// are kept (they may name an n>1 parent).
    pub fn resolve_abort(&mut self, ids: &[String], internal: bool) -> Vec<String> {
        let mut out = Vec::new();
        for id in ids {
            if internal {
                if let Some(slot) = self.by_id.get(id.as_str()) {
                    let ext = self.slots[*slot].as_ref().unwrap().external.clone();
                    self.unlink_external(&ext, id);
                }
                out.push(id.clone());
            } else if let Some(internals) = self.external.remove(id) {
                out.extend(internals);
            }
        }
        out
    }

    /// Step 2 of `abort_requests`: pop the state of one resolved internal id.
    pub fn pop_aborted(&mut self, id: &str) -> Option<T> {
        self.take_state(id)
    }
}

/// The multimodal hashes missing in P1 during one step, in first-seen order,
/// each once: every one is invalidated in P0's sender cache exactly once.
/// (Content hashes of client-sent media: keyed as well.)
#[derive(Default)]
pub struct MissSet {
    order: Vec<String>,
    seen: HashSet<String, IdBuild>,
}

impl MissSet {
    pub fn add(&mut self, hash: &str) -> bool {
        if self.seen.contains(hash) {
            return false;
        }
        self.seen.insert(hash.to_owned());
        self.order.push(hash.to_owned());
        true
    }
    pub fn is_empty(&self) -> bool {
        self.order.is_empty()
    }
    pub fn hashes(&self) -> &[String] {
        &self.order
    }
    pub fn clear(&mut self) {
        self.order.clear();
        self.seen.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table() -> Table<u32> {
        let mut t = Table::default();
        t.insert("a", "X", 1).unwrap();
        t.insert("b", "X", 2).unwrap();
        t.insert("c", "Y", 3).unwrap();
        t
    }

    /// Ids around the inline limit (and multi-byte ones across it) are kept
    /// whole, found by `&str`, and distinct from their prefixes.
    #[test]
    fn ids_short_and_long_round_trip() {
        let long = "r".repeat(INLINE_ID);
        let ids = [
            String::new(),
            "chatcmpl-0123456789abcdef0123456789abcdef-0-89abcdef".to_owned(),
            long.clone(),
            format!("{long}x"),
            format!("{}é", "r".repeat(INLINE_ID - 1)),
            "é".repeat(INLINE_ID),
        ];
        let mut t = Table::default();
        for (i, id) in ids.iter().enumerate() {
            assert_eq!(IdKey::new(id).as_str(), id);
            t.insert(id, "X", i).unwrap();
        }
        for (i, id) in ids.iter().enumerate() {
            assert_eq!(t.by_id(id), Some(&i), "{id:?}");
        }
        assert_eq!(t.by_id(&long[1..]), None);
        let mut seen: Vec<&str> = t.ids().collect();
        seen.sort_unstable();
        let mut want: Vec<&str> = ids.iter().map(String::as_str).collect();
        want.sort_unstable();
        assert_eq!(seen, want);
        for id in &ids {
            assert!(t.remove(id).is_some());
        }
        assert!(t.is_empty());
    }

    /// Steps of outputs in changing orders, with requests finishing, joining
    /// (reusing freed slots) and unknown ids: the guessed lookup always answers
    /// what the map answers.
    #[test]
    fn step_lookup_equals_map_lookup_whatever_the_order() {
        let mut rng: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = move |n: usize| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            (rng % n as u64) as usize
        };
        let mut t: Table<usize> = Table::default();
        let mut live: Vec<String> = Vec::new();
        let mut born = 0;
        for _step in 0..300 {
            for _ in 0..next(4) {
                let id = format!("cmpl-{born:032x}-0-{born:08x}");
                t.insert(&id, "X", born).unwrap();
                live.push(id);
                born += 1;
            }
            // Mostly the last order; sometimes a swap, an unknown id, a finish.
            if live.len() > 1 && next(3) == 0 {
                let (a, b) = (next(live.len()), next(live.len()));
                live.swap(a, b);
            }
            t.start_step();
            let mut order: Vec<String> = live.clone();
            if next(5) == 0 {
                order.insert(next(order.len() + 1), "aborted-earlier".to_owned());
            }
            for id in &order {
                assert_eq!(t.step_slot_of(id), t.slot_of(id), "{id}");
            }
            for _ in 0..next(3) {
                if !live.is_empty() {
                    let id = live.remove(next(live.len()));
                    assert!(t.remove(&id).is_some());
                }
            }
        }
        assert!(born > 200);
    }

    /// Walking the guesses from the first gives the last step's order, which
    /// is what the loop prefetches ahead of its lookups.
    #[test]
    fn guesses_walk_the_last_steps_order() {
        let mut t: Table<usize> = Table::default();
        assert_eq!(t.first_guess(), NO_SLOT);
        for (i, id) in ["a", "b", "c", "d"].iter().enumerate() {
            t.insert(id, "X", i).unwrap();
        }
        let order = ["c", "a", "d", "b"];
        t.start_step();
        for id in order {
            t.step_slot_of(id).unwrap();
        }
        let mut walked = Vec::new();
        let mut s = t.first_guess();
        while s != NO_SLOT && walked.len() < 10 {
            walked.push(s);
            t.prefetch_slot(s, 4);
            s = t.guess_after(s);
        }
        let want: Vec<usize> = order.iter().map(|id| t.slot_of(id).unwrap()).collect();
        assert_eq!(walked, want);
        assert_eq!(t.guess_after(NO_SLOT), NO_SLOT);
        t.prefetch_slot(NO_SLOT, 4);
    }

    #[test]
    fn double_add_is_an_error_and_keeps_the_first() {
        let mut t = table();
        assert_eq!(
            t.insert("a", "Z", 9),
            Err(TableError::Duplicate("a".into()))
        );
        assert_eq!(t.by_id("a"), Some(&1));
        assert_eq!(t.external_ids("Z"), None);
        assert_eq!(t.len(), 3);
    }

    #[test]
    fn remove_unlinks_external_and_reuses_slots() {
        let mut t = table();
        let slot_a = t.slot_of("a").unwrap();
        assert_eq!(t.remove("a"), Some(1));
        assert_eq!(t.external_ids("X").unwrap(), &vec!["b".to_string()]);
        assert_eq!(t.remove("b"), Some(2));
        assert!(t.external_ids("X").is_none());
        assert_eq!(t.remove("b"), None);
        let slot_b = 1 - slot_a; // "a" and "b" took the first two slots
        let s = t.insert("d", "Z", 4).unwrap();
        // A freed slot is reused (the last freed first), the slot vector does not grow.
        assert_eq!(s, slot_b);
        assert_eq!(t.slots.len(), 3);
        assert_eq!(t.slot_of("d"), Some(s));
        assert_eq!(t.by_id("d"), Some(&4));
        assert_eq!(t.insert("e", "Z", 5).unwrap(), slot_a);
        assert_eq!(t.insert("f", "Z", 6).unwrap(), 3);
        assert_eq!(t.len(), 4);
    }

    #[test]
    fn abort_by_external_takes_every_internal_id_in_order() {
        let mut t = table();
        let ids = t.resolve_abort(&["X".into(), "nope".into()], false);
        assert_eq!(ids, vec!["a".to_string(), "b".to_string()]);
        assert!(t.external_ids("X").is_none());
        assert_eq!(t.pop_aborted("a"), Some(1));
        assert_eq!(t.pop_aborted("b"), Some(2));
        assert_eq!(t.pop_aborted("a"), None);
        assert_eq!(t.len(), 1);
    }

    #[test]
    fn abort_by_internal_keeps_unknown_ids_for_parent_lookup() {
        let mut t = table();
        let ids = t.resolve_abort(&["b".into(), "parent-1".into()], true);
        assert_eq!(ids, vec!["b".to_string(), "parent-1".to_string()]);
        assert_eq!(t.external_ids("X").unwrap(), &vec!["a".to_string()]);
        assert_eq!(t.pop_aborted("b"), Some(2));
        assert_eq!(t.pop_aborted("parent-1"), None);
        // The sibling under the same external id is untouched.
        assert_eq!(t.by_id("a"), Some(&1));
    }

    #[test]
    fn miss_set_is_ordered_and_deduplicated() {
        let mut m = MissSet::default();
        assert!(m.is_empty());
        assert!(m.add("h2"));
        assert!(m.add("h1"));
        assert!(!m.add("h2"));
        assert!(m.add("h3"));
        assert_eq!(m.hashes(), &["h2", "h1", "h3"]);
        m.clear();
        assert!(m.is_empty());
        assert!(m.add("h1"));
    }

    #[test]
    fn flood_ids_collide_under_fxhash_by_construction() {
        use std::hash::BuildHasher;
        let ids = flood_ids(2000);
        let distinct: HashSet<&String> = ids.iter().collect();
        assert_eq!(distinct.len(), ids.len());
        let fx = FxBuild::default();
        let h0 = fx.hash_one(&ids[0]);
        assert!(
            ids.iter().all(|id| fx.hash_one(id) == h0),
            "the construction is wrong"
        );
        assert_ne!(fx.hash_one("0_req"), h0);
    }

    #[test]
    fn flood_ids_do_not_collide_under_the_keyed_hash() {
        use std::hash::{BuildHasher, BuildHasherDefault, DefaultHasher};
        let ids = flood_ids(2000);
        // SipHash-1-3 with fixed keys (deterministic) and with the table's own random
        // keys: every id gets its own 64-bit hash, and the low bits hashbrown uses to
        // pick a bucket spread over (nearly) all of a 4096-bucket table's buckets.
        let fixed = BuildHasherDefault::<DefaultHasher>::default();
        let random = IdBuild::default();
        for hashes in [
            ids.iter()
                .map(|id| fixed.hash_one(id))
                .collect::<Vec<u64>>(),
            ids.iter().map(|id| random.hash_one(id)).collect(),
        ] {
            let distinct: HashSet<u64> = hashes.iter().copied().collect();
            assert_eq!(distinct.len(), ids.len());
            let buckets: HashSet<u64> = hashes.iter().map(|h| h & 4095).collect();
            assert!(buckets.len() > 1400, "{} buckets", buckets.len());
        }
    }

    #[test]
    fn table_of_flood_ids_works() {
        let ids = flood_ids(500);
        let mut t: Table<usize> = Table::default();
        for (i, id) in ids.iter().enumerate() {
            t.insert(id, id, i).unwrap();
        }
        assert!(ids
            .iter()
            .enumerate()
            .all(|(i, id)| t.by_id(id) == Some(&i)));
        assert!(ids.iter().all(|id| t.remove(id).is_some()));
        assert!(t.is_empty());
    }
}
