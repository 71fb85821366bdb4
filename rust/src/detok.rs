//! Incremental detokenization and stop strings, step for step identical to vLLM 0.32's
//! `FastIncrementalDetokenizer` (vllm/v1/engine/detokenizer.py) on Hugging Face fast
//! tokenizers.
//!
//! vLLM drives `tokenizers.decoders.DecodeStream`, whose step re-decodes a small window
//! of ids with the tokenizer's full decoder. We run the same algorithm
//! (`tokenizers::tokenizer::step_decode_stream`, re-implemented over reusable buffers),
//! and for the two decoder pipelines real vocabularies use (byte-level BPE, and
//! SentencePiece's Replace/ByteFallback/Fuse/Strip) we decode from a per-token table
//! built once from the tokenizer itself instead of calling the decoder chain, which
//! allocates a String per token. Any other decoder goes through `Tokenizer::decode`, so
//! the result is the same either way; `Vocab::self_check` compares the two.

use smallvec::SmallVec;

use crate::inline::InlineStr;
use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use tokenizers::decoders::DecoderWrapper;
use tokenizers::{Decoder, Tokenizer};

/// The message prefix vLLM matches to recover from a broken `DecodeStream`.
const INVALID_PREFIX_ERR_MSG: &str = "Invalid prefix encountered";
const REPLACEMENT: char = '\u{FFFD}';

#[derive(Debug)]
pub enum DetokError {
    /// The tokenizer definition could not be loaded.
    Load(String),
    /// The decoder failed (vLLM re-raises these).
    Decode(String),
}

impl fmt::Display for DetokError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DetokError::Load(m) => write!(f, "cannot load tokenizer: {m}"),
            DetokError::Decode(m) => write!(f, "{m}"),
        }
    }
}

impl std::error::Error for DetokError {}

/// Why a request must go through vLLM's Python detokenizer instead; `label()` names the
/// counter. Tokenizer-level reasons are decided by the caller (it sees the Python
/// tokenizer object), request-level ones by [`supports`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FallbackReason {
    /// Not a `transformers.TokenizersBackend`: vLLM uses `SlowIncrementalDetokenizer`.
    SlowTokenizer,
    /// `tokenizer_mode=mistral` (mistral_common): also the slow path in vLLM.
    MistralTokenizer,
    /// `VLLM_USE_FASTOKENS=1` swaps DecodeStream for another implementation.
    Fastokens,
    /// The tokenizer cannot be serialized to JSON (e.g. a custom Python decoder).
    Unserializable,
    /// The Python `tokenizers` is not the 0.23 line whose decoders we embed.
    TokenizersVersion,
    /// A stop string is empty (vLLM rejects these, but never guess).
    EmptyStopString,
    /// A token id that does not fit u32 (vLLM logs and skips it in Python).
    TokenIdOutOfRange,
}

impl FallbackReason {
    pub fn label(self) -> &'static str {
        match self {
            FallbackReason::SlowTokenizer => "slow_tokenizer",
            FallbackReason::MistralTokenizer => "mistral_tokenizer",
            FallbackReason::Fastokens => "fastokens",
            FallbackReason::Unserializable => "unserializable_tokenizer",
            FallbackReason::TokenizersVersion => "tokenizers_version",
            FallbackReason::EmptyStopString => "empty_stop_string",
            FallbackReason::TokenIdOutOfRange => "token_id_out_of_range",
        }
    }
}

/// Request-level check: can [`DetokState`] reproduce vLLM for these parameters?
pub fn supports(params: &DetokParams) -> Result<(), FallbackReason> {
    if params.stop.iter().any(|s| s.is_empty()) {
        return Err(FallbackReason::EmptyStopString);
    }
    Ok(())
}

// ---------------------------------------------------------------------------------
// Vocabulary: the tokenizer plus a per-token decode table.
// ---------------------------------------------------------------------------------

const PRESENT: u8 = 1;
const SPECIAL: u8 = 2;
const BYTE: u8 = 4;

/// One token id: its decoded piece in `arena[off..off+len]`, or a fallback byte.
#[derive(Clone, Copy, Default)]
struct Entry {
    off: u32,
    len: u32,
    flags: u8,
    byte: u8,
}

enum Pipeline {
    /// `ByteLevel`: per-token bytes, concatenated, then UTF-8-lossy as a whole.
    ByteLevel,
    /// `Sequence[Replace*, ByteFallback?, Fuse, Strip(c, start, 0)?]`: per-token text or a
    /// fallback byte; runs of bytes become text if valid UTF-8, else one U+FFFD per byte;
    /// then `start` leading `c` are stripped from the fused string.
    Spm { strip: Option<(char, usize)> },
}

struct FastTable {
    pipeline: Pipeline,
    entries: Vec<Entry>,
    arena: Vec<u8>,
}

/// A tokenizer loaded once and shared (behind `Arc`) by every request.
pub struct Vocab {
    tok: Tokenizer,
    fast: Option<FastTable>,
    /// Added tokens' content by id (vLLM's `added_token_ids`).
    added: HashMap<u32, Box<str>>,
}

/// Reusable buffers for one decode.
#[derive(Default)]
pub struct Scratch {
    bytes: Vec<u8>,
}

/// A self-check mismatch: (ids, skip_special_tokens, ours, reference).
pub type Mismatch = (Vec<u32>, bool, String, String);

/// A tokenizer that cannot be read or reproduced, with the loader's message.
fn load_err(e: impl ToString) -> DetokError {
    DetokError::Load(e.to_string())
}

impl Vocab {
    /// From the JSON of the exact tokenizer vLLM uses (`tokenizer._tokenizer.to_str()`).
    pub fn from_json(json: &str) -> Result<Self, DetokError> {
        let tok: Tokenizer = json.parse().map_err(load_err)?;
        Self::from_tokenizer(tok)
    }

    /// From a `tokenizer.json` file.
    pub fn from_file(path: &str) -> Result<Self, DetokError> {
        let tok = Tokenizer::from_file(path).map_err(load_err)?;
        Self::from_tokenizer(tok)
    }

    pub fn from_tokenizer(tok: Tokenizer) -> Result<Self, DetokError> {
        let added = tok
            .get_added_tokens_decoder()
            .into_iter()
            .map(|(id, t)| (id, t.content.into_boxed_str()))
            .collect();
        let fast = FastTable::build(&tok)?;
        Ok(Vocab { tok, fast, added })
    }

    /// The same vocabulary decoding through `Tokenizer::decode` only (for comparisons).
    pub fn generic(mut self) -> Self {
        self.fast = None;
        self
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tok
    }

    /// Whether decoding uses the per-token table (else `Tokenizer::decode`).
    pub fn has_fast_decoder(&self) -> bool {
        self.fast.is_some()
    }

    /// `Tokenizer::decode`, through the table when there is one.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, DetokError> {
        let mut out = String::new();
        self.decode_into(ids, skip_special_tokens, &mut out, &mut Scratch::default())?;
        Ok(out)
    }

    /// The crate's own decode, for comparison.
    pub fn decode_reference(&self, ids: &[u32], skip: bool) -> Result<String, DetokError> {
        self.tok
            .decode(ids, skip)
            .map_err(|e| DetokError::Decode(format!("{e}")))
    }

    fn decode_into(
        &self,
        ids: &[u32],
        skip: bool,
        out: &mut String,
        scratch: &mut Scratch,
    ) -> Result<(), DetokError> {
        out.clear();
        match &self.fast {
            Some(t) => {
                t.decode_into(ids, skip, out, scratch);
                Ok(())
            }
            None => {
                out.push_str(&self.decode_reference(ids, skip)?);
                Ok(())
            }
        }
    }

    /// Compares the table decode with the crate's decode on every single token (both
    /// `skip_special_tokens` values) and on `n_random` pseudo-random sequences; returns
    /// the first mismatches as (ids, skip, ours, reference).
    pub fn self_check(
        &self,
        n_random: usize,
        max_len: usize,
        seed: u64,
    ) -> Result<Vec<Mismatch>, DetokError> {
        let mut bad = Vec::new();
        let n = self.fast.as_ref().map_or(0, |t| t.entries.len()) as u32;
        let check = |ids: &[u32], bad: &mut Vec<_>| -> Result<(), DetokError> {
            for skip in [false, true] {
                let ours = self.decode(ids, skip)?;
                let reference = self.decode_reference(ids, skip)?;
                if ours != reference && bad.len() < 20 {
                    bad.push((ids.to_vec(), skip, ours, reference));
                }
            }
            Ok(())
        };
        for id in 0..n + 2 {
            check(&[id], &mut bad)?;
        }
        // Sequences biased towards the interesting ids: byte-fallback, special, spaces.
        let interesting: Vec<u32> = match &self.fast {
            Some(t) => (0..n)
                .filter(|&i| {
                    let e = t.entries[i as usize];
                    e.flags & (BYTE | SPECIAL) != 0
                        || t.arena
                            .get(e.off as usize..(e.off + e.len) as usize)
                            .is_some_and(|p| p.first().is_some_and(|b| *b == b' ' || *b >= 0x80))
                })
                .collect(),
            None => vec![],
        };
        let mut rng = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let mut next = || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        let vocab_n = self.tok.get_vocab_size(true).max(1) as u64;
        for _ in 0..n_random {
            let len = (next() % max_len.max(1) as u64) as usize + 1;
            let ids: Vec<u32> = (0..len)
                .map(|_| {
                    let r = next();
                    if !interesting.is_empty() && r % 3 != 0 {
                        interesting[(r / 3 % interesting.len() as u64) as usize]
                    } else {
                        (r / 3 % (vocab_n + 2)) as u32
                    }
                })
                .collect();
            check(&ids, &mut bad)?;
        }
        Ok(bad)
    }
}

/// The decoder pipeline a table can reproduce, with what its per-token stages need.
struct Recognized {
    pipeline: Pipeline,
    /// The `Replace` stages of an SPM pipeline, applied to each token in order.
    replaces: Vec<DecoderWrapper>,
    /// Whether an SPM pipeline has `ByteFallback` ("<0xHH>" tokens are bytes).
    byte_fallback: bool,
}

/// A decoder stage's `type` in the tokenizer's JSON.
fn stage_kind(v: &serde_json::Value) -> &str {
    v.get("type").and_then(|t| t.as_str()).unwrap_or("")
}

impl Recognized {
    /// Recognizes the decoder pipeline; None means "use `Tokenizer::decode`".
    fn from_tokenizer(tok: &Tokenizer) -> Result<Option<Self>, DetokError> {
        let Some(decoder) = tok.get_decoder() else {
            return Ok(None);
        };
        let json = serde_json::to_value(decoder).map_err(load_err)?;
        match stage_kind(&json) {
            "ByteLevel" => Ok(Some(Recognized {
                pipeline: Pipeline::ByteLevel,
                replaces: Vec::new(),
                byte_fallback: false,
            })),
            "Sequence" => match json.get("decoders").and_then(|d| d.as_array()) {
                Some(stages) => Self::spm(stages),
                None => Ok(None),
            },
            _ => Ok(None),
        }
    }

    /// `Sequence[Replace*, ByteFallback?, Fuse, Strip(c, start, 0)?]`, or None.
    fn spm(stages: &[serde_json::Value]) -> Result<Option<Self>, DetokError> {
        let mut replaces = Vec::new();
        let mut i = 0;
        while i < stages.len() && stage_kind(&stages[i]) == "Replace" {
            replaces.push(serde_json::from_value(stages[i].clone()).map_err(load_err)?);
            i += 1;
        }
        let byte_fallback = i < stages.len() && stage_kind(&stages[i]) == "ByteFallback";
        if byte_fallback {
            i += 1;
        }
        if !(i < stages.len() && stage_kind(&stages[i]) == "Fuse") {
            return Ok(None);
        }
        i += 1;
        let mut strip = None;
        if i < stages.len() && stage_kind(&stages[i]) == "Strip" {
            let Some(s) = strip_of(&stages[i]) else {
                return Ok(None);
            };
            strip = Some(s);
            i += 1;
        }
        if i != stages.len() {
            return Ok(None);
        }
        Ok(Some(Recognized {
            pipeline: Pipeline::Spm { strip },
            replaces,
            byte_fallback,
        }))
    }

    /// One token's bytes under an SPM pipeline: its text after the `Replace`
    /// stages, or the byte a `ByteFallback` "<0xHH>" token stands for.
    fn spm_piece(&self, token: String) -> Result<SpmPiece, DetokError> {
        let mut piece = vec![token];
        for r in &self.replaces {
            piece = r.decode_chain(piece).map_err(load_err)?;
        }
        let [piece] = <[String; 1]>::try_from(piece)
            .map_err(|_| DetokError::Load("Replace changed the token count".into()))?;
        // Exactly ByteFallback's test for a "<0xHH>" token.
        if self.byte_fallback
            && piece.len() == 6
            && piece.starts_with("<0x")
            && piece.ends_with('>')
        {
            if let Ok(b) = u8::from_str_radix(&piece[3..5], 16) {
                return Ok(SpmPiece::Byte(b));
            }
        }
        Ok(SpmPiece::Text(piece))
    }
}

/// A `Strip` stage the table reproduces: one character, stripped `start` times
/// from the left and never from the right.
fn strip_of(s: &serde_json::Value) -> Option<(char, usize)> {
    let content = s.get("content").and_then(|c| c.as_str()).unwrap_or("");
    let mut chars = content.chars();
    let (Some(c), None) = (chars.next(), chars.next()) else {
        return None;
    };
    let start = s.get("start").and_then(|v| v.as_u64());
    let stop = s.get("stop").and_then(|v| v.as_u64());
    match (start, stop) {
        (Some(start), Some(0)) => Some((c, start as usize)),
        _ => None,
    }
}

enum SpmPiece {
    Text(String),
    Byte(u8),
}

impl FastTable {
    /// The per-token decode table of a recognized pipeline; None means "use
    /// `Tokenizer::decode`".
    fn build(tok: &Tokenizer) -> Result<Option<Self>, DetokError> {
        let Some(rec) = Recognized::from_tokenizer(tok)? else {
            return Ok(None);
        };
        let n = tok
            .get_vocab(true)
            .values()
            .copied()
            .max()
            .map_or(0, |m| m as usize + 1);
        let added = tok.get_added_vocabulary();
        let char_bytes = byte_level_char_to_byte();
        let mut entries = vec![Entry::default(); n];
        let mut arena = Vec::new();
        for (id, entry) in entries.iter_mut().enumerate() {
            let Some(token) = tok.id_to_token(id as u32) else {
                continue;
            };
            let mut flags = PRESENT;
            if added.is_special_token(&token) {
                flags |= SPECIAL;
            }
            let off = arena.len() as u32;
            let mut byte = 0;
            match rec.pipeline {
                Pipeline::ByteLevel => {
                    let mapped: Option<Vec<u8>> =
                        token.chars().map(|c| char_bytes.get(&c).copied()).collect();
                    arena.extend_from_slice(&mapped.unwrap_or_else(|| token.as_bytes().to_vec()));
                }
                Pipeline::Spm { .. } => match rec.spm_piece(token)? {
                    SpmPiece::Byte(b) => {
                        flags |= BYTE;
                        byte = b;
                    }
                    SpmPiece::Text(piece) => arena.extend_from_slice(piece.as_bytes()),
                },
            }
            *entry = Entry {
                off,
                len: arena.len() as u32 - off,
                flags,
                byte,
            };
        }
        Ok(Some(FastTable {
            pipeline: rec.pipeline,
            entries,
            arena,
        }))
    }

    #[inline]
    fn decode_into(&self, ids: &[u32], skip: bool, out: &mut String, scratch: &mut Scratch) {
        let skip_mask = if skip { SPECIAL } else { 0 };
        let run = &mut scratch.bytes;
        run.clear();
        match self.pipeline {
            Pipeline::ByteLevel => {
                for &id in ids {
                    let Some(e) = self.entries.get(id as usize) else {
                        continue;
                    };
                    if e.flags & PRESENT == 0 || e.flags & skip_mask != 0 {
                        continue;
                    }
                    run.extend_from_slice(&self.arena[e.off as usize..(e.off + e.len) as usize]);
                }
                out.push_str(&String::from_utf8_lossy(run));
            }
            Pipeline::Spm { strip } => {
                for &id in ids {
                    let Some(e) = self.entries.get(id as usize) else {
                        continue;
                    };
                    if e.flags & PRESENT == 0 || e.flags & skip_mask != 0 {
                        continue;
                    }
                    if e.flags & BYTE != 0 {
                        run.push(e.byte);
                        continue;
                    }
                    flush_byte_run(run, out);
                    // Pieces were stored from Strings, so they are valid UTF-8.
                    let piece = &self.arena[e.off as usize..(e.off + e.len) as usize];
                    out.push_str(std::str::from_utf8(piece).unwrap_or_default());
                }
                flush_byte_run(run, out);
                if let Some((c, start)) = strip {
                    let cut: usize = out
                        .chars()
                        .take(start)
                        .take_while(|&x| x == c)
                        .map(char::len_utf8)
                        .sum();
                    if cut > 0 {
                        out.replace_range(..cut, "");
                    }
                }
            }
        }
    }
}

/// ByteFallback: a run of byte tokens is its text when valid UTF-8, else U+FFFD per byte.
#[inline]
fn flush_byte_run(run: &mut Vec<u8>, out: &mut String) {
    if run.is_empty() {
        return;
    }
    match std::str::from_utf8(run) {
        Ok(s) => out.push_str(s),
        Err(_) => out.extend(std::iter::repeat_n(REPLACEMENT, run.len())),
    }
    run.clear();
}

/// GPT-2's byte <-> printable char map, inverted (as the ByteLevel decoder uses it).
fn byte_level_char_to_byte() -> HashMap<char, u8> {
    let mut bs: Vec<u8> = (b'!'..=b'~')
        .chain(0xA1..=0xAC)
        .chain(0xAE..=0xFF)
        .collect();
    let mut cs: Vec<u32> = bs.iter().map(|&b| b as u32).collect();
    let mut n = 0;
    for b in 0..=255u8 {
        if !bs.contains(&b) {
            bs.push(b);
            cs.push(256 + n);
            n += 1;
        }
    }
    bs.into_iter()
        .zip(cs)
        .filter_map(|(b, c)| char::from_u32(c).map(|c| (c, b)))
        .collect()
}

// ---------------------------------------------------------------------------------
// DecodeStream: tokenizers' `step_decode_stream`, over reusable buffers.
// ---------------------------------------------------------------------------------

/// The stream's window of ids: a token or a few once the prompt is behind it,
/// kept in the request's state instead of behind a pointer (a cold cache line
/// less per request-step at big batches).
type StreamIds = SmallVec<[u32; 8]>;

/// Bytes of the stream's prefix text kept inline: the text of a few tokens.
const INLINE_PREFIX: usize = 30;

/// The stream's prefix text, inline when short (almost always after the first
/// step), else on the heap.
type Prefix = InlineStr<INLINE_PREFIX>;

#[derive(Default)]
struct Stream {
    ids: StreamIds,
    prefix: Prefix,
    prefix_index: usize,
}

/// The buffers one detokenizer step fills and leaves nothing in that a later step
/// reads. One set serves every request of an output processor: kept per request, they
/// would be that much more cold memory to touch for each request of a big batch.
#[derive(Default)]
pub struct StepBuffers {
    scratch: Scratch,
    /// The decode of the stream's ids (the candidate string).
    candidate: String,
    /// A prefix decode that replaces the stream's empty prefix unless it ends in U+FFFD.
    spare: String,
    /// The text one token adds.
    piece: String,
    /// The text's length in code points after each token of the step (stop strings).
    offsets: Vec<usize>,
}

impl Stream {
    fn new(ids: &[u32]) -> Self {
        Stream {
            ids: StreamIds::from_slice(ids),
            ..Default::default()
        }
    }

    /// One `DecodeStream.step(tokenizer, id)`; on Some, the new text is appended to
    /// `b.piece`.
    fn step(
        &mut self,
        vocab: &Vocab,
        id: u32,
        skip: bool,
        b: &mut StepBuffers,
    ) -> Result<bool, DetokError> {
        if self.prefix.as_str().is_empty() && !self.ids.is_empty() {
            vocab.decode_into(&self.ids, skip, &mut b.spare, &mut b.scratch)?;
            if !b.spare.ends_with(REPLACEMENT) {
                self.prefix = Prefix::new(&b.spare);
                self.prefix_index = self.ids.len();
            }
        }
        self.ids.push(id);
        vocab.decode_into(&self.ids, skip, &mut b.candidate, &mut b.scratch)?;
        let string = &b.candidate;
        let prefix = self.prefix.as_str();
        if string.len() > prefix.len() && !string.ends_with(REPLACEMENT) {
            if !string.starts_with(prefix) {
                return Err(DetokError::Decode(format!(
                    "{INVALID_PREFIX_ERR_MSG} while decoding stream. Token ID: {id}, \
                     Expected prefix: '{prefix}', Actual string: '{string}'",
                )));
            }
            b.piece.push_str(&string[prefix.len()..]);
            let new_prefix_index = self.ids.len() - self.prefix_index;
            self.ids.drain(..self.prefix_index);
            // Back inline once the prompt has left the window.
            self.ids.shrink_to_fit();
            vocab.decode_into(&self.ids, skip, &mut b.spare, &mut b.scratch)?;
            self.prefix = Prefix::new(&b.spare);
            self.prefix_index = new_prefix_index;
            Ok(true)
        } else {
            Ok(false)
        }
    }
}

// ---------------------------------------------------------------------------------
// Per-request state: vLLM's BaseIncrementalDetokenizer + FastIncrementalDetokenizer.
// ---------------------------------------------------------------------------------

#[derive(Debug, Clone, Default)]
pub struct DetokParams {
    pub skip_special_tokens: bool,
    pub spaces_between_special_tokens: bool,
    pub stop: Vec<String>,
    pub include_stop_str_in_output: bool,
    pub min_tokens: usize,
}

pub struct DetokState {
    vocab: Arc<Vocab>,
    stream: Stream,
    skip_special_tokens: bool,
    /// False only when added tokens exist and the request asked for no spaces between
    /// them: then consecutive added tokens are emitted as their raw content.
    spaces_between_special_tokens: bool,
    last_special: bool,
    stop: Vec<String>,
    stop_chars: Vec<usize>,
    include_stop_str_in_output: bool,
    min_tokens: usize,
    stop_buffer_length: usize,
    token_ids: Vec<u32>,
    output_text: String,
    /// `len(output_text)` in code points, as Python counts.
    output_chars: usize,
    last_output_chars: usize,
    /// Byte offset of `last_output_chars`, or usize::MAX if it must be recomputed.
    last_output_byte: usize,
}

impl DetokState {
    /// `FastIncrementalDetokenizer(tokenizer, request)`; `prompt_token_ids` primes the
    /// decode stream exactly like `DecodeStream(ids=prompt_token_ids)`.
    pub fn new(vocab: Arc<Vocab>, prompt_token_ids: &[u32], params: DetokParams) -> Self {
        let stop_chars: Vec<usize> = params.stop.iter().map(|s| s.chars().count()).collect();
        let stop_buffer_length = if !params.stop.is_empty() && !params.include_stop_str_in_output {
            stop_chars
                .iter()
                .copied()
                .max()
                .unwrap_or(0)
                .saturating_sub(1)
        } else {
            0
        };
        let spaces_between = (params.skip_special_tokens || params.spaces_between_special_tokens)
            || vocab.added.is_empty();
        DetokState {
            stream: Stream::new(prompt_token_ids),
            vocab,
            skip_special_tokens: params.skip_special_tokens,
            spaces_between_special_tokens: spaces_between,
            last_special: false,
            stop: params.stop,
            stop_chars,
            include_stop_str_in_output: params.include_stop_str_in_output,
            min_tokens: params.min_tokens,
            stop_buffer_length,
            token_ids: Vec::new(),
            output_text: String::new(),
            output_chars: 0,
            last_output_chars: 0,
            last_output_byte: 0,
        }
    }

    pub fn num_output_tokens(&self) -> usize {
        self.token_ids.len()
    }

    pub fn output_token_ids(&self) -> &[u32] {
        &self.token_ids
    }

    /// Prefetch where the next step appends: the ends of the ids and the text.
    pub fn prefetch_tails(&self) {
        crate::prefetch::line(self.token_ids.as_ptr().wrapping_add(self.token_ids.len()));
        crate::prefetch::line(
            self.output_text
                .as_ptr()
                .wrapping_add(self.output_text.len()),
        );
    }

    /// The whole text so far (vLLM's `output_text` attribute).
    pub fn text(&self) -> &str {
        &self.output_text
    }

    /// Code points already handed out as deltas (vLLM's `_last_output_text_offset`).
    pub fn last_output_offset(&self) -> usize {
        self.last_output_chars
    }

    /// `_protected_step` + the spaces_between_special_tokens rule: the token's text in
    /// `b.piece`.
    fn decode_next(&mut self, id: u32, b: &mut StepBuffers) -> Result<(), DetokError> {
        b.piece.clear();
        let vocab = &*self.vocab;
        let skip = self.skip_special_tokens;
        let r = self.stream.step(vocab, id, skip, b);
        if let Err(DetokError::Decode(m)) = &r {
            if !m.starts_with(INVALID_PREFIX_ERR_MSG) {
                return Err(DetokError::Decode(m.clone()));
            }
            // vLLM resets the stream without the prompt and steps again.
            self.stream = Stream::default();
            b.piece.clear();
            self.stream.step(vocab, id, skip, b)?;
        } else {
            r?;
        }
        if !self.spaces_between_special_tokens {
            let special = vocab.added.get(&id);
            if let (Some(content), true) = (special, self.last_special) {
                b.piece.clear();
                b.piece.push_str(content);
            }
            self.last_special = special.is_some();
        }
        Ok(())
    }

    /// `BaseIncrementalDetokenizer.update`: detokenizes `new_ids`, checks stop strings,
    /// and on a match truncates text and drops ids past the one completing it. Returns
    /// the matched stop string.
    pub fn update(
        &mut self,
        b: &mut StepBuffers,
        new_ids: &[u32],
        stop_terminated: bool,
    ) -> Result<Option<String>, DetokError> {
        let Some((&last, rest)) = new_ids.split_last() else {
            return Ok(None);
        };
        let (to_decode, skipped) = if stop_terminated && !self.include_stop_str_in_output {
            (rest, Some(last))
        } else {
            (new_ids, None)
        };
        let check_stop = !self.stop.is_empty();
        let num_prev = self.token_ids.len();
        b.offsets.clear();
        if check_stop {
            b.offsets.push(self.output_chars);
        }
        for &id in to_decode {
            self.token_ids.push(id);
            self.decode_next(id, b)?;
            self.output_text.push_str(&b.piece);
            self.output_chars += b.piece.chars().count();
            if check_stop {
                b.offsets.push(self.output_chars);
            }
        }
        if let Some(id) = skipped {
            self.token_ids.push(id);
            if check_stop {
                b.offsets.push(self.output_chars);
            }
        }
        if !check_stop || self.token_ids.len() <= self.min_tokens {
            return Ok(None);
        }
        let stop_check_offset = b.offsets[self.min_tokens.saturating_sub(num_prev)];
        let Some((which, truncate_to)) = check_stop_strings(
            &self.output_text,
            self.output_chars,
            self.output_chars - stop_check_offset,
            &self.stop,
            &self.stop_chars,
            self.include_stop_str_in_output,
        ) else {
            return Ok(None);
        };
        let mut stop_end = truncate_to.unwrap_or(self.output_chars);
        if !self.include_stop_str_in_output {
            stop_end += self.stop_chars[which];
        }
        // bisect_left(offsets, stop_end, lo=1)
        let num_kept = 1 + b.offsets[1..].partition_point(|&o| o < stop_end);
        self.token_ids.truncate(num_prev + num_kept);
        if let Some(t) = truncate_to {
            let b = char_to_byte(&self.output_text, self.output_chars, t);
            self.output_text.truncate(b);
            self.output_chars = t;
            if self.last_output_chars > t {
                self.last_output_byte = usize::MAX;
            }
        }
        Ok(Some(self.stop[which].clone()))
    }

    /// `get_next_output_text(finished, delta)`, borrowed.
    pub fn output_text_ref(&mut self, finished: bool, delta: bool) -> &str {
        let buffer = if finished { 0 } else { self.stop_buffer_length };
        if !delta {
            if buffer == 0 {
                return &self.output_text;
            }
            let end = self.output_chars.saturating_sub(buffer);
            return &self.output_text[..char_to_byte(&self.output_text, self.output_chars, end)];
        }
        if self.output_chars < buffer || self.last_output_chars >= self.output_chars - buffer {
            return "";
        }
        let length = self.output_chars - buffer;
        let start = if self.last_output_byte == usize::MAX {
            char_to_byte(&self.output_text, self.output_chars, self.last_output_chars)
        } else {
            self.last_output_byte
        };
        let end = char_to_byte(&self.output_text, self.output_chars, length);
        self.last_output_chars = length;
        self.last_output_byte = end;
        &self.output_text[start..end]
    }

    /// `get_next_output_text(finished, delta)`.
    pub fn output_text(&mut self, finished: bool, delta: bool) -> String {
        self.output_text_ref(finished, delta).to_owned()
    }
}

/// Byte offset of code point `ci` in `s` (which has `n_chars` code points); walks from
/// the nearer end, and stop windows sit at the end.
fn char_to_byte(s: &str, n_chars: usize, ci: usize) -> usize {
    if ci >= n_chars {
        return s.len();
    }
    let back = n_chars - ci;
    if back <= ci {
        s.char_indices().rev().nth(back - 1).map_or(0, |(b, _)| b)
    } else {
        s.char_indices().nth(ci).map_or(s.len(), |(b, _)| b)
    }
}

/// vLLM's `check_stop_strings`, in code points. Returns (index into `stop`, truncate_to)
/// where None means "no truncation" (vLLM's -1).
fn check_stop_strings(
    text: &str,
    text_chars: usize,
    new_char_count: usize,
    stop: &[String],
    stop_chars: &[usize],
    include_in_output: bool,
) -> Option<(usize, Option<usize>)> {
    if new_char_count == 0 || stop.is_empty() {
        return None;
    }
    let mut best: Option<(usize, usize, usize)> = None; // (which, index, end)
    for (which, (s, &len)) in stop.iter().zip(stop_chars).enumerate() {
        // str.find(s, 1 - new_char_count - len): a negative start counts from the end.
        let start = (text_chars + 1).saturating_sub(new_char_count + len);
        let start_b = char_to_byte(text, text_chars, start);
        let Some(found_b) = text[start_b..].find(s.as_str()) else {
            continue;
        };
        let index = start + text[start_b..start_b + found_b].chars().count();
        let end = index + len;
        if best.is_none_or(|(_, _, e)| end < e) {
            best = Some((which, index, end));
        }
    }
    let (which, index, end) = best?;
    if include_in_output {
        return Some((which, if end >= text_chars { None } else { Some(end) }));
    }
    Some((which, Some(index)))
}

pub mod py;

#[cfg(test)]
mod tests;
