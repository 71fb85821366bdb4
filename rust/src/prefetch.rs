//! Cache-line prefetch hints. At big batches each request's state is cold when
//! the output loop reaches it; the loop asks for the next requests' lines a few
//! requests ahead so their misses overlap instead of stalling one by one.
//! A prefetch reads nothing and never faults, so any address is allowed: a
//! wrong or stale one only costs a wasted hint.

const LINE: usize = 64;

/// Hint that the cache line holding `p` is needed soon.
#[inline(always)]
pub fn line<T: ?Sized>(p: *const T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: PREFETCHT0 has no architectural effect besides cache state; it
    // does not access memory for the program and cannot fault.
    unsafe {
        core::arch::x86_64::_mm_prefetch::<{ core::arch::x86_64::_MM_HINT_T0 }>(p.cast::<i8>());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// Hint that the `bytes` bytes from `p` are needed soon (at most `max_lines`
/// lines, so a long buffer does not flood the caches).
#[inline]
pub fn lines<T: ?Sized>(p: *const T, bytes: usize, max_lines: usize) {
    let start = p.cast::<u8>();
    let n = bytes.div_ceil(LINE).min(max_lines);
    for i in 0..n {
        line(start.wrapping_add(i * LINE));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hints_for_any_address_do_not_fault() {
        let v = vec![1u8; 1000];
        lines(v.as_ptr(), v.len(), 32);
        line(std::ptr::null::<u8>());
        line(usize::MAX as *const u8);
        lines(std::ptr::dangling::<u64>(), 1 << 20, 4);
        assert_eq!(v[999], 1);
    }
}
