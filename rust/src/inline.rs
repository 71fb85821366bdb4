//! `InlineStr`: a short string kept inside its owner (a map bucket, a request's
//! state) instead of behind a pointer, so reading it costs no extra cache line;
//! longer strings go to the heap. Pure Rust, unit-tested.

/// A string of up to `N` bytes stored inline, longer ones on the heap.
#[derive(Clone)]
pub enum InlineStr<const N: usize> {
    Inline(u8, [u8; N]),
    Heap(Box<str>),
}

impl<const N: usize> Default for InlineStr<N> {
    fn default() -> Self {
        InlineStr::Inline(0, [0; N])
    }
}

impl<const N: usize> InlineStr<N> {
    /// `N` must fit the inline length byte.
    const FITS: () = assert!(N <= u8::MAX as usize);

    pub fn new(text: &str) -> Self {
        let () = Self::FITS;
        let b = text.as_bytes();
        if b.len() <= N {
            let mut buf = [0u8; N];
            buf[..b.len()].copy_from_slice(b);
            InlineStr::Inline(b.len() as u8, buf)
        } else {
            InlineStr::Heap(text.into())
        }
    }

    pub fn as_str(&self) -> &str {
        match self {
            // SAFETY: `new` copied exactly these bytes from a `&str` and nothing
            // writes them afterwards, so they are UTF-8. (Checking them on every
            // read would cost what keeping them inline saves.)
            InlineStr::Inline(len, buf) => unsafe {
                std::str::from_utf8_unchecked(&buf[..*len as usize])
            },
            InlineStr::Heap(s) => s,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::InlineStr;

    /// Strings around the inline limit, multi-byte ones across it included,
    /// come back whole.
    #[test]
    fn round_trips_short_and_long() {
        let long = "r".repeat(8);
        for s in [
            String::new(),
            "abc".to_owned(),
            long.clone(),
            format!("{long}x"),
            format!("{}é", "r".repeat(7)),
            "é".repeat(8),
        ] {
            assert_eq!(InlineStr::<8>::new(&s).as_str(), s);
        }
        assert!(matches!(
            InlineStr::<8>::new(&long),
            InlineStr::Inline(8, _)
        ));
        assert!(matches!(
            InlineStr::<8>::new(&format!("{long}x")),
            InlineStr::Heap(_)
        ));
    }
}
