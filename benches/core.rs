// Criterion benches for the pure-Rust core (filled in by the native-loop work).
use criterion::{criterion_group, criterion_main, Criterion};

fn placeholder(c: &mut Criterion) {
    c.bench_function("version", |b| b.iter(|| vllm_mmretry::VERSION.len()));
}

criterion_group!(benches, placeholder);
criterion_main!(benches);
