//! A reader for the engine core's msgpack `EngineCoreOutputs` messages.
//!
//! vLLM encodes `EngineCoreOutputs` and each `EngineCoreOutput` as msgspec
//! `array_like` structs: a msgpack array of the fields in declaration order, with
//! trailing defaults left out. This reader handles the common message only: every
//! per-request output made of a request id, token ids, a finish reason, a stop
//! reason and a count, every other output field nil. It answers `None` for anything
//! else (another type in a field, an ext value, a truncated or oversized array, bad
//! UTF-8), and the caller hands the message to vLLM's own decoder. Top-level fields
//! other than the outputs are returned as raw msgpack, for vLLM's decoders.
//!
//! Pure Rust, no Python; the binding is `wire/py.rs`.

/// What the reader accepts in one field of a per-request output.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// A string.
    Str,
    /// An array of integers.
    IntList,
    /// Nil or a non-negative integer (an IntEnum value).
    OptEnum,
    /// Nil, an integer or a string.
    OptIntOrStr,
    /// An integer.
    Int,
    /// Nil only; any other value is not the common message.
    Nil,
}

/// One output field as read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Val<'a> {
    Nil,
    Int(i64),
    Str(&'a str),
    Ints(Vec<i64>),
}

/// Where the fields are: the adapter's facts about the running vLLM's structs.
#[derive(Clone, Debug)]
pub struct Layout {
    /// How many fields `EngineCoreOutputs` declares.
    pub top_fields: usize,
    /// The position of its `outputs` field.
    pub outputs_at: usize,
    /// What each `EngineCoreOutput` field may hold, in declaration order.
    pub output: Vec<Kind>,
    /// How many of those have no default (they lead: msgspec requires it).
    pub output_required: usize,
}

/// A message as read: the top-level fields present on the wire.
#[derive(Debug, PartialEq, Eq)]
pub struct Message<'a> {
    /// Raw msgpack of each top-level field present, by position (`None` when nil);
    /// the entry at `outputs_at` is always `None`.
    pub top: Vec<Option<&'a [u8]>>,
    /// The per-request outputs (empty when the field is absent), each field by position.
    pub outputs: Vec<Vec<Val<'a>>>,
}

/// Reads `buf` as one `EngineCoreOutputs`; `None` when it is not the common message.
pub fn read<'a>(layout: &Layout, buf: &'a [u8]) -> Option<Message<'a>> {
    let mut r = Reader { buf, pos: 0 };
    let n = r.array_len()?;
    if n > layout.top_fields {
        return None;
    }
    let mut top = Vec::with_capacity(n);
    let mut outputs = Vec::new();
    for i in 0..n {
        if i == layout.outputs_at {
            outputs = read_outputs(&mut r, layout)?;
            top.push(None);
        } else if r.take_nil()? {
            top.push(None);
        } else {
            top.push(Some(r.skip()?));
        }
    }
    (r.pos == buf.len()).then_some(Message { top, outputs })
}

fn read_outputs<'a>(r: &mut Reader<'a>, layout: &Layout) -> Option<Vec<Vec<Val<'a>>>> {
    let kinds = &layout.output;
    let n = r.array_len()?;
    // Each output takes at least one byte: a bound before allocating.
    if n > r.remaining() {
        return None;
    }
    let mut outputs = Vec::with_capacity(n);
    for _ in 0..n {
        let m = r.array_len()?;
        // A required field missing, or more fields than declared, is vLLM's
        // decoder's error to raise.
        if m < layout.output_required || m > kinds.len() {
            return None;
        }
        let mut fields = Vec::with_capacity(m);
        for &kind in &kinds[..m] {
            fields.push(read_field(r, kind)?);
        }
        outputs.push(fields);
    }
    Some(outputs)
}

fn read_field<'a>(r: &mut Reader<'a>, kind: Kind) -> Option<Val<'a>> {
    match kind {
        Kind::Str => r.str().map(Val::Str),
        Kind::Int => r.int().map(Val::Int),
        Kind::IntList => {
            let n = r.array_len()?;
            if n > r.remaining() {
                return None;
            }
            (0..n)
                .map(|_| r.int())
                .collect::<Option<Vec<_>>>()
                .map(Val::Ints)
        }
        Kind::Nil => r.take_nil()?.then_some(Val::Nil),
        Kind::OptEnum => {
            if r.take_nil()? {
                Some(Val::Nil)
            } else {
                r.int().filter(|v| *v >= 0).map(Val::Int)
            }
        }
        Kind::OptIntOrStr => {
            if r.take_nil()? {
                return Some(Val::Nil);
            }
            match r.peek()? {
                0xa0..=0xbf | 0xd9..=0xdb => r.str().map(Val::Str),
                _ => r.int().map(Val::Int),
            }
        }
    }
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn peek(&self) -> Option<u8> {
        self.buf.get(self.pos).copied()
    }

    fn byte(&mut self) -> Option<u8> {
        let b = self.peek()?;
        self.pos += 1;
        Some(b)
    }

    fn bytes(&mut self, n: usize) -> Option<&'a [u8]> {
        let end = self.pos.checked_add(n)?;
        let s = self.buf.get(self.pos..end)?;
        self.pos = end;
        Some(s)
    }

    fn be(&mut self, n: usize) -> Option<u64> {
        Some(
            self.bytes(n)?
                .iter()
                .fold(0u64, |acc, &b| (acc << 8) | u64::from(b)),
        )
    }

    /// True (and consumed) when the next value is nil.
    fn take_nil(&mut self) -> Option<bool> {
        let nil = self.peek()? == 0xc0;
        if nil {
            self.pos += 1;
        }
        Some(nil)
    }

    fn array_len(&mut self) -> Option<usize> {
        let n = match self.byte()? {
            b @ 0x90..=0x9f => u64::from(b & 0x0f),
            0xdc => self.be(2)?,
            0xdd => self.be(4)?,
            _ => return None,
        };
        usize::try_from(n).ok()
    }

    fn str(&mut self) -> Option<&'a str> {
        let n = match self.byte()? {
            b @ 0xa0..=0xbf => u64::from(b & 0x1f),
            0xd9 => self.be(1)?,
            0xda => self.be(2)?,
            0xdb => self.be(4)?,
            _ => return None,
        };
        let bytes = self.bytes(usize::try_from(n).ok()?)?;
        std::str::from_utf8(bytes).ok()
    }

    /// An integer that fits i64 (a larger uint64 is not the common message).
    fn int(&mut self) -> Option<i64> {
        match self.byte()? {
            b @ 0x00..=0x7f => Some(i64::from(b)),
            b @ 0xe0..=0xff => Some(i64::from(b as i8)),
            0xcc => self.be(1).map(|v| v as i64),
            0xcd => self.be(2).map(|v| v as i64),
            0xce => self.be(4).map(|v| v as i64),
            0xcf => self.be(8).and_then(|v| i64::try_from(v).ok()),
            0xd0 => self.be(1).map(|v| i64::from(v as u8 as i8)),
            0xd1 => self.be(2).map(|v| i64::from(v as u16 as i16)),
            0xd2 => self.be(4).map(|v| i64::from(v as u32 as i32)),
            0xd3 => self.be(8).map(|v| v as i64),
            _ => None,
        }
    }

    /// Skips one value of any type; its raw bytes.
    fn skip(&mut self) -> Option<&'a [u8]> {
        let start = self.pos;
        // Values still to skip; each takes at least one byte, so more than the
        // bytes left is a malformed message (and no overflow, no recursion).
        let mut pending: usize = 1;
        while pending > 0 {
            pending -= 1;
            let (body, items) = self.header()?;
            self.bytes(body)?;
            pending = pending.checked_add(items)?;
            if pending > self.remaining() {
                return None;
            }
        }
        Some(&self.buf[start..self.pos])
    }

    /// Reads a value's header: the bytes of its body and how many values follow it.
    fn header(&mut self) -> Option<(usize, usize)> {
        let b = self.byte()?;
        let len = |r: &mut Self, n: usize| r.be(n).and_then(|v| usize::try_from(v).ok());
        Some(match b {
            0x00..=0x7f | 0xe0..=0xff | 0xc0 | 0xc2 | 0xc3 => (0, 0),
            0x80..=0x8f => (0, usize::from(b & 0x0f) * 2),
            0x90..=0x9f => (0, usize::from(b & 0x0f)),
            0xa0..=0xbf => (usize::from(b & 0x1f), 0),
            0xcc | 0xd0 => (1, 0),
            0xcd | 0xd1 => (2, 0),
            0xce | 0xd2 | 0xca => (4, 0),
            0xcf | 0xd3 | 0xcb => (8, 0),
            0xc4 | 0xd9 => (len(self, 1)?, 0),
            0xc5 | 0xda => (len(self, 2)?, 0),
            0xc6 | 0xdb => (len(self, 4)?, 0),
            0xdc => (0, len(self, 2)?),
            0xdd => (0, len(self, 4)?),
            0xde => (0, len(self, 2)?.checked_mul(2)?),
            0xdf => (0, len(self, 4)?.checked_mul(2)?),
            0xd4 => (2, 0),
            0xd5 => (3, 0),
            0xd6 => (5, 0),
            0xd7 => (9, 0),
            0xd8 => (17, 0),
            0xc7 => (len(self, 1)?.checked_add(1)?, 0),
            0xc8 => (len(self, 2)?.checked_add(1)?, 0),
            0xc9 => (len(self, 4)?.checked_add(1)?, 0),
            _ => return None, // 0xc1, never used
        })
    }
}

#[cfg(test)]
mod tests;

pub mod py;
