//! Criterion benches for the pure-Rust core: the native incremental detokenizer,
//! and the request table under a flood of colliding request ids.
//!
//! A batch of 1024 requests, each stepping one token per engine step (update + delta
//! text), as vLLM's output loop does at batch 1024. Throughput is request-steps.
//! Needs the real vocabularies built by tools/tiny_model.py and tools/tekken_tokenizer.py
//! (looked up under $VLLM_MMRETRY_CACHE or ./.cache); without them it benches nothing.

use std::hint::black_box;
use std::path::PathBuf;
use std::sync::Arc;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use vllm_mmretry::detok::{DetokParams, DetokState, StepBuffers, Vocab};
use vllm_mmretry::table::{flood_ids, FxBuild, IdBuild, Table};

const BATCH: usize = 1024;
const TEXT: &str = "The quick brown fox jumps over the lazy dog, then writes a short essay \
    about naïve café owners in Zürich — 東京の天気は晴れです 🦀. Numbers: 3.14159, 2718; \
    code: fn main() { println!(\"hi\"); }\n";

fn tokenizer_json(prefix: &str) -> Option<PathBuf> {
    let root = std::env::var("VLLM_MMRETRY_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|_| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".cache"));
    ["models", "tokenizers"].iter().find_map(|sub| {
        std::fs::read_dir(root.join(sub))
            .ok()?
            .flatten()
            .find_map(|e| {
                let f = e.path().join("tokenizer.json");
                (e.file_name().to_string_lossy().starts_with(prefix) && f.exists()).then_some(f)
            })
    })
}

struct Batch {
    vocab: Arc<Vocab>,
    params: DetokParams,
    prompt: Vec<u32>,
    gen: Vec<u32>,
    reqs: Vec<(DetokState, usize)>,
    bufs: StepBuffers,
}

impl Batch {
    fn new(vocab: Arc<Vocab>, params: DetokParams) -> Self {
        let enc = |s: &str| {
            vocab
                .tokenizer()
                .encode(s, false)
                .expect("encode")
                .get_ids()
                .to_vec()
        };
        let prompt = enc("Please write an essay about foxes and dogs.");
        let gen = enc(&TEXT.repeat(40));
        let reqs = (0..BATCH)
            .map(|i| {
                (
                    DetokState::new(vocab.clone(), &prompt, params.clone()),
                    i * 7 % gen.len(),
                )
            })
            .collect();
        Batch {
            vocab,
            params,
            prompt,
            gen,
            reqs,
            bufs: StepBuffers::default(),
        }
    }

    /// One engine step: every request gets one token and emits its delta text.
    fn step(&mut self) -> usize {
        let mut n = 0;
        for (st, pos) in &mut self.reqs {
            if *pos == self.gen.len() {
                *st = DetokState::new(self.vocab.clone(), &self.prompt, self.params.clone());
                *pos = 0;
            }
            let stop = st
                .update(&mut self.bufs, &self.gen[*pos..*pos + 1], false)
                .expect("update");
            *pos += 1;
            n += st.output_text_ref(stop.is_some(), true).len();
            if stop.is_some() {
                *pos = self.gen.len();
            }
        }
        n
    }
}

fn detok(c: &mut Criterion) {
    let mut g = c.benchmark_group("detok_step_batch1024");
    g.throughput(Throughput::Elements(BATCH as u64));
    for (name, prefix) in [("llama", "tiny-llava"), ("tekken", "tekken")] {
        let Some(path) = tokenizer_json(prefix) else {
            eprintln!("no {name} tokenizer.json under the cache; skipping");
            continue;
        };
        let vocab = Arc::new(Vocab::from_file(path.to_str().unwrap()).expect("load"));
        let generic = Arc::new(
            Vocab::from_file(path.to_str().unwrap())
                .expect("load")
                .generic(),
        );
        let plain = DetokParams {
            skip_special_tokens: true,
            spaces_between_special_tokens: true,
            ..Default::default()
        };
        let stops = DetokParams {
            stop: vec!["zebra".into(), "\n\n\n".into()],
            ..plain.clone()
        };
        for (label, v, p) in [
            ("table", &vocab, &plain),
            ("table+2stops", &vocab, &stops),
            ("crate_decode", &generic, &plain),
        ] {
            let mut b = Batch::new(v.clone(), p.clone());
            g.bench_function(format!("{name}/{label}"), |bench| {
                bench.iter(|| black_box(b.step()))
            });
        }
    }
    g.finish();
}

/// The Rust share of one output-loop step at batch 1024, no Python: per engine
/// output, find the request by its id in the request table, detokenize its new
/// token (stop strings checked), take the delta text; finished requests leave the
/// table and a new one takes their place (as the loop's finish/add do).
fn loop_step(c: &mut Criterion) {
    let mut g = c.benchmark_group("loop_step_batch1024");
    g.throughput(Throughput::Elements(BATCH as u64));
    let Some(path) = tokenizer_json("tiny-llava") else {
        eprintln!("no llama tokenizer.json under the cache; skipping");
        return;
    };
    let vocab = Arc::new(Vocab::from_file(path.to_str().unwrap()).expect("load"));
    let enc = |s: &str| {
        vocab
            .tokenizer()
            .encode(s, false)
            .expect("encode")
            .get_ids()
            .to_vec()
    };
    let prompt = enc("Please write an essay about foxes and dogs.");
    let gen = enc(&TEXT.repeat(40));
    for (label, stop) in [
        ("plain", vec![]),
        ("2stops", vec!["zebra".to_string(), "\n\n\n".to_string()]),
    ] {
        let params = DetokParams {
            skip_special_tokens: true,
            spaces_between_special_tokens: true,
            stop,
            ..Default::default()
        };
        let mut table: Table<(DetokState, usize)> = Table::default();
        let ids: Vec<String> = (0..BATCH).map(|i| format!("cmpl-{i:08x}-0")).collect();
        for (i, id) in ids.iter().enumerate() {
            table
                .insert(
                    id,
                    id,
                    (
                        DetokState::new(vocab.clone(), &prompt, params.clone()),
                        i * 7 % gen.len(),
                    ),
                )
                .unwrap();
        }
        let mut bufs = StepBuffers::default();
        g.bench_function(label, |bench| {
            bench.iter(|| {
                let mut n = 0;
                for id in &ids {
                    let slot = table.slot_of(id).expect("tracked");
                    let (st, pos) = table.get_mut(slot).unwrap();
                    let stop = st
                        .update(&mut bufs, &gen[*pos..*pos + 1], false)
                        .expect("update");
                    *pos += 1;
                    n += st.output_text_ref(stop.is_some(), true).len();
                    if stop.is_some() || *pos == gen.len() {
                        table.remove(id);
                        table
                            .insert(
                                id,
                                id,
                                (DetokState::new(vocab.clone(), &prompt, params.clone()), 0),
                            )
                            .unwrap();
                    }
                }
                black_box(n)
            })
        });
    }
    g.finish();
}

const FLOOD: usize = 2048;

/// Same-length (16 ASCII bytes) ids from a fixed pseudo-random sequence.
fn random_ids(n: usize) -> Vec<String> {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            format!("{:016x}", x)
        })
        .collect()
}

/// Client-chosen ids: `FLOOD` requests added, each looked up, all finished, with
/// ids built to collide under the former FxHash vs random ids. The table (keyed
/// SipHash) should cost the same for both; a plain FxHash map shows the flood.
fn table_flood(c: &mut Criterion) {
    let mut g = c.benchmark_group("table_2048_ids");
    g.throughput(Throughput::Elements(FLOOD as u64));
    let kinds = [
        ("random", random_ids(FLOOD)),
        ("fx_colliding", flood_ids(FLOOD)),
    ];
    for (kind, ids) in &kinds {
        g.bench_function(format!("table/{kind}"), |bench| {
            bench.iter(|| {
                let mut t: Table<usize> = Table::default();
                for (i, id) in ids.iter().enumerate() {
                    t.insert(id, id, i).unwrap();
                }
                let mut n = 0;
                for id in ids {
                    n += t.slot_of(id).unwrap();
                }
                for id in ids {
                    t.remove(id);
                }
                black_box(n)
            })
        });
    }
    for (label, build) in [
        ("fxhash_map", None),
        ("siphash_map", Some(IdBuild::default())),
    ] {
        for (kind, ids) in &kinds {
            g.bench_function(format!("{label}/{kind}"), |bench| {
                bench.iter(|| match &build {
                    None => black_box(fill_and_read(ids, FxBuild::default())),
                    Some(b) => black_box(fill_and_read(ids, b.clone())),
                })
            });
        }
    }
    g.finish();
}

fn fill_and_read<S: std::hash::BuildHasher>(ids: &[String], build: S) -> usize {
    let mut m: std::collections::HashMap<&str, usize, S> =
        std::collections::HashMap::with_hasher(build);
    for (i, id) in ids.iter().enumerate() {
        m.insert(id, i);
    }
    ids.iter().map(|id| m[id.as_str()]).sum()
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20).measurement_time(std::time::Duration::from_secs(3));
    targets = detok, loop_step, table_flood
}
criterion_main!(benches);
