//! Cheaper prometheus_client updates for vLLM's stat loggers.
//!
//! With statistics on, vLLM's `PrometheusStatLogger.record` runs for every
//! engine-output message: a dozen counter increments (most of them of zero),
//! gauge sets and histogram observations, each a chain of four Python calls in
//! prometheus_client. The binding (`py.rs`) gives single metric children
//! (`Counter`, `Gauge`, `Histogram` holding a `MutexValue`) an `inc`, `set` or
//! `observe` that makes the same update in one native call: the same lock, the
//! same Python arithmetic on the stored value, the same bucket. vLLM's `record`
//! itself still runs unchanged. This part is the bucket choice, in plain Rust.

pub mod py;

/// The bucket `Histogram.observe` counts `amount` in: the first whose upper
/// bound is at least `amount`; none for NaN (every comparison is false).
pub fn bucket_for(bounds: &[f64], amount: f64) -> Option<usize> {
    bounds.iter().position(|b| amount <= *b)
}

#[cfg(test)]
mod tests {
    use super::bucket_for;

    const BOUNDS: [f64; 4] = [0.001, 0.5, 10.0, f64::INFINITY];

    #[test]
    fn an_amount_goes_to_the_first_bound_at_or_above_it() {
        assert_eq!(bucket_for(&BOUNDS, 0.0), Some(0));
        assert_eq!(bucket_for(&BOUNDS, 0.001), Some(0));
        assert_eq!(bucket_for(&BOUNDS, 0.0011), Some(1));
        assert_eq!(bucket_for(&BOUNDS, 10.0), Some(2));
        assert_eq!(bucket_for(&BOUNDS, 1e300), Some(3));
        assert_eq!(bucket_for(&BOUNDS, f64::INFINITY), Some(3));
        assert_eq!(bucket_for(&BOUNDS, -5.0), Some(0));
    }

    #[test]
    fn nan_and_amounts_past_every_bound_go_nowhere() {
        assert_eq!(bucket_for(&BOUNDS, f64::NAN), None);
        assert_eq!(bucket_for(&[1.0, 2.0], 3.0), None);
        assert_eq!(bucket_for(&[], 0.0), None);
    }
}
