//! Unit tests: golden cases on small synthetic vocabularies, differential tests against
//! the tokenizers crate's own `step_decode_stream`, and (when the project cache holds
//! them) the same on the real Llama and Tekken vocabularies.

use super::*;
use tokenizers::tokenizer::step_decode_stream;

/// A Llama-style SentencePiece BPE: Metaspace, byte fallback, Strip of the first space.
fn spm_vocab() -> Arc<Vocab> {
    let mut vocab = serde_json::Map::new();
    let mut push = |t: String| {
        let id = vocab.len();
        vocab.insert(t, serde_json::json!(id));
    };
    for t in ["<unk>", "<s>", "</s>"] {
        push(t.into());
    }
    for b in 0..=255u32 {
        push(format!("<0x{b:02X}>"));
    }
    for t in [
        "▁Hello", "▁world", "!", "▁", "▁wor", "ld", "é", "▁stop", "▁the", "x",
    ] {
        push(t.into());
    }
    let n = vocab.len();
    let json = serde_json::json!({
        "version": "1.0",
        "added_tokens": [
            {"id": 0, "content": "<unk>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
            {"id": 1, "content": "<s>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
            {"id": 2, "content": "</s>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
            {"id": n, "content": "<image>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
            {"id": n + 1, "content": "<tool>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": false},
            {"id": n + 2, "content": "<x▁y>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": false}
        ],
        "normalizer": null,
        "pre_tokenizer": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": false},
        "post_processor": null,
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
        "model": {"type": "BPE", "dropout": null, "unk_token": "<unk>", "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": true, "byte_fallback": true,
                  "ignore_merges": false, "vocab": vocab, "merges": []}
    });
    Arc::new(Vocab::from_json(&json.to_string()).expect("spm vocab"))
}

/// A GPT-2 style byte-level BPE with one special token.
fn byte_level_vocab() -> Arc<Vocab> {
    let mut vocab = serde_json::Map::new();
    let mut chars: Vec<(char, u8)> = byte_level_char_to_byte().into_iter().collect();
    chars.sort_by_key(|&(_, b)| b);
    for (c, _) in &chars {
        let id = vocab.len();
        vocab.insert(c.to_string(), serde_json::json!(id));
    }
    for t in ["Hello", "Ġworld", "ĠÃ©", "Ġstop"] {
        let id = vocab.len();
        vocab.insert(t.into(), serde_json::json!(id));
    }
    let n = vocab.len();
    let json = serde_json::json!({
        "version": "1.0",
        "added_tokens": [
            {"id": n, "content": "<|end|>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}
        ],
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                  "ignore_merges": false, "vocab": vocab, "merges": []}
    });
    Arc::new(Vocab::from_json(&json.to_string()).expect("byte-level vocab"))
}

fn id(v: &Vocab, t: &str) -> u32 {
    v.tokenizer()
        .token_to_id(t)
        .unwrap_or_else(|| panic!("no token {t}"))
}

fn params(skip: bool) -> DetokParams {
    DetokParams {
        skip_special_tokens: skip,
        spaces_between_special_tokens: true,
        ..Default::default()
    }
}

/// Runs steps, returning each step's (delta text, stop string).
fn run(st: &mut DetokState, steps: &[Vec<u32>]) -> Vec<(String, Option<String>)> {
    let mut bufs = StepBuffers::default();
    steps
        .iter()
        .map(|s| {
            let stop = st.update(&mut bufs, s, false).expect("update");
            (st.output_text(stop.is_some(), true), stop)
        })
        .collect()
}

#[test]
fn golden_spm_prompt_priming_keeps_the_leading_space() {
    let v = spm_vocab();
    let prompt = [1, id(&v, "▁Hello")];
    let mut st = DetokState::new(v.clone(), &prompt, params(true));
    let out = run(&mut st, &[vec![id(&v, "▁world")], vec![id(&v, "!")]]);
    assert_eq!(out[0].0, " world");
    assert_eq!(out[1].0, "!");
    // Without a prompt the first token's leading space is stripped, as in vLLM.
    let mut st = DetokState::new(v.clone(), &[], params(true));
    let out = run(&mut st, &[vec![id(&v, "▁world")], vec![id(&v, "▁the")]]);
    assert_eq!((out[0].0.as_str(), out[1].0.as_str()), ("world", " the"));
}

#[test]
fn utf8_split_across_byte_fallback_tokens() {
    let v = spm_vocab();
    let b = |x: u8| id(&v, &format!("<0x{x:02X}>"));
    let mut st = DetokState::new(v.clone(), &[1], params(true));
    // "é" = C3 A9, "🦀" = F0 9F A6 80
    let steps: Vec<Vec<u32>> = [0xC3, 0xA9, 0xF0, 0x9F, 0xA6, 0x80]
        .iter()
        .map(|&x| vec![b(x)])
        .collect();
    let deltas: Vec<String> = run(&mut st, &steps).into_iter().map(|d| d.0).collect();
    assert_eq!(deltas, ["", "é", "", "", "", "🦀"]);
    assert_eq!(st.text(), "é🦀");
    assert_eq!(st.num_output_tokens(), 6);
}

#[test]
fn utf8_split_across_byte_level_tokens() {
    let v = byte_level_vocab();
    // "é" = C3 A9 -> byte-level chars 'Ã' '©'
    let mut st = DetokState::new(v.clone(), &[id(&v, "Hello")], params(true));
    let out = run(
        &mut st,
        &[vec![id(&v, "Ã")], vec![id(&v, "©")], vec![id(&v, "Ġworld")]],
    );
    let deltas: Vec<&str> = out.iter().map(|d| d.0.as_str()).collect();
    assert_eq!(deltas, ["", "é", " world"]);
}

#[test]
fn stop_string_in_the_middle_of_a_multi_token_step() {
    let v = spm_vocab();
    let p = DetokParams {
        stop: vec!["wor".into()],
        ..params(true)
    };
    let mut st = DetokState::new(v.clone(), &[1], p.clone());
    let step = vec![
        id(&v, "▁Hello"),
        id(&v, "▁world"),
        id(&v, "!"),
        id(&v, "▁the"),
    ];
    let stop = st
        .update(&mut StepBuffers::default(), &step, false)
        .unwrap();
    assert_eq!(stop.as_deref(), Some("wor"));
    // Tokens after the one completing "wor" are dropped; text ends before the stop.
    assert_eq!(st.output_token_ids(), &step[..2]);
    assert_eq!(st.output_text(true, false), "Hello ");

    let p = DetokParams {
        include_stop_str_in_output: true,
        ..p
    };
    let mut st = DetokState::new(v.clone(), &[1], p);
    let stop = st
        .update(&mut StepBuffers::default(), &step, false)
        .unwrap();
    assert_eq!(stop.as_deref(), Some("wor"));
    assert_eq!(st.output_token_ids(), &step[..2]);
    assert_eq!(st.output_text(true, false), "Hello wor");
}

#[test]
fn earliest_completing_stop_wins_and_buffer_holds_back_text() {
    let v = spm_vocab();
    let p = DetokParams {
        stop: vec!["the".into(), "world".into()],
        ..params(true)
    };
    let mut st = DetokState::new(v.clone(), &[1], p);
    assert_eq!(
        st.update(&mut StepBuffers::default(), &[id(&v, "▁Hello")], false)
            .unwrap(),
        None
    );
    // buffer = max(len) - 1 = 4 chars held back from "Hello"
    assert_eq!(st.output_text(false, true), "H");
    let stop = st
        .update(
            &mut StepBuffers::default(),
            &[id(&v, "▁world"), id(&v, "▁the")],
            false,
        )
        .unwrap();
    assert_eq!(stop.as_deref(), Some("world"));
    assert_eq!(st.output_text(true, true), "ello ");
}

#[test]
fn min_tokens_defers_stop_checks() {
    let v = spm_vocab();
    let p = DetokParams {
        stop: vec!["Hello".into()],
        min_tokens: 2,
        ..params(true)
    };
    let mut st = DetokState::new(v.clone(), &[1], p);
    assert_eq!(
        st.update(&mut StepBuffers::default(), &[id(&v, "▁Hello")], false)
            .unwrap(),
        None
    );
    // The check resumes on text after token #2, so the earlier "Hello" no longer counts.
    assert_eq!(
        st.update(
            &mut StepBuffers::default(),
            &[id(&v, "▁world"), id(&v, "▁Hello")],
            false
        )
        .unwrap(),
        Some("Hello".into())
    );
    assert_eq!(st.output_text(true, false), "Hello world ");
}

#[test]
fn stop_terminated_token_is_counted_but_not_detokenized() {
    let v = spm_vocab();
    let mut st = DetokState::new(v.clone(), &[1], params(false));
    assert_eq!(
        st.update(&mut StepBuffers::default(), &[id(&v, "▁Hello"), 2], true)
            .unwrap(),
        None
    );
    assert_eq!(st.output_token_ids(), &[id(&v, "▁Hello"), 2]);
    // skip_special_tokens=false: the prompt decodes to "<s>", so the space stays.
    assert_eq!(st.output_text(true, false), " Hello");
    let p = DetokParams {
        include_stop_str_in_output: true,
        ..params(false)
    };
    let mut st = DetokState::new(v.clone(), &[1], p);
    st.update(&mut StepBuffers::default(), &[id(&v, "▁Hello"), 2], true)
        .unwrap();
    assert_eq!(st.output_text(true, false), " Hello</s>");
}

#[test]
fn no_spaces_between_consecutive_added_tokens() {
    let v = spm_vocab();
    let img = id(&v, "<image>");
    let tool = id(&v, "<tool>");
    let p = DetokParams {
        spaces_between_special_tokens: false,
        ..params(false)
    };
    let mut st = DetokState::new(v.clone(), &[1], p.clone());
    st.update(
        &mut StepBuffers::default(),
        &[img, tool, id(&v, "▁Hello"), img],
        false,
    )
    .unwrap();
    // The second of two consecutive added tokens is emitted as its raw content.
    let with = {
        let mut s = DetokState::new(v.clone(), &[1], params(false));
        s.update(
            &mut StepBuffers::default(),
            &[img, tool, id(&v, "▁Hello"), img],
            false,
        )
        .unwrap();
        s.text().to_owned()
    };
    assert_eq!(st.text(), "<image><tool> Hello<image>");
    assert_eq!(with, "<image><tool> Hello<image>"); // this decoder adds no spaces anyway

    // Visible when an added token's decoding differs from its content (▁ -> space).
    let xy = id(&v, "<x▁y>");
    let mut st = DetokState::new(v.clone(), &[1], p.clone());
    st.update(
        &mut StepBuffers::default(),
        &[xy, img, xy, id(&v, "▁Hello"), xy],
        false,
    )
    .unwrap();
    assert_eq!(st.text(), "<x y><image><x▁y> Hello<x y>");
    let mut st = DetokState::new(v.clone(), &[1], params(false));
    st.update(&mut StepBuffers::default(), &[xy, img, xy], false)
        .unwrap();
    assert_eq!(st.text(), "<x y><image><x y>");
}

#[test]
fn stop_strings_count_code_points() {
    let text = "aé🦀bé🦀";
    let n = text.chars().count();
    let stop = vec!["é🦀".to_string()];
    let chars = vec![2];
    // new text = last 3 chars "bé🦀": the earlier "é🦀" is outside the search window.
    assert_eq!(
        check_stop_strings(text, n, 3, &stop, &chars, false),
        Some((0, Some(4)))
    );
    assert_eq!(
        check_stop_strings(text, n, 3, &stop, &chars, true),
        Some((0, None))
    );
    assert_eq!(
        check_stop_strings(text, n, 5, &stop, &chars, true),
        Some((0, Some(3)))
    );
    assert_eq!(char_to_byte(text, n, 3), "aé🦀".len());
}

/// The crate's `step_decode_stream` for one request, primed like
/// `DecodeStream(ids=prompt)`, reset without the prompt on a prefix error as vLLM does.
struct Reference {
    ids: Vec<u32>,
    prefix: String,
    prefix_index: usize,
}

impl Reference {
    fn step(&mut self, v: &Vocab, t: u32, skip: bool) -> String {
        let step = |r: &mut Self| {
            step_decode_stream(
                v.tokenizer(),
                vec![t],
                skip,
                &mut r.ids,
                &mut r.prefix,
                &mut r.prefix_index,
            )
        };
        match step(self) {
            Ok(s) => s.unwrap_or_default(),
            Err(e) if e.to_string().starts_with(INVALID_PREFIX_ERR_MSG) => {
                (self.ids, self.prefix, self.prefix_index) = (vec![], String::new(), 0);
                step(self).unwrap().unwrap_or_default()
            }
            Err(e) => panic!("{e}"),
        }
    }
}

/// Our states vs the reference, all requests stepped in turn with one set of step
/// buffers, as the output processor steps them.
fn differential(v: &Arc<Vocab>, seqs: &[(Vec<u32>, Vec<u32>)]) {
    for skip in [false, true] {
        let mut bufs = StepBuffers::default();
        let mut reqs: Vec<_> = seqs
            .iter()
            .map(|(prompt, _)| {
                let st = DetokState::new(v.clone(), prompt, params(skip));
                let r = Reference {
                    ids: prompt.clone(),
                    prefix: String::new(),
                    prefix_index: 0,
                };
                (st, r, String::new())
            })
            .collect();
        let longest = seqs.iter().map(|(_, gen)| gen.len()).max().unwrap_or(0);
        for k in 0..longest {
            for ((st, r, text), (prompt, gen)) in reqs.iter_mut().zip(seqs) {
                let Some(&t) = gen.get(k) else { continue };
                let expected = r.step(v, t, skip);
                text.push_str(&expected);
                st.update(&mut bufs, &[t], false).unwrap();
                assert_eq!(
                    st.output_text(false, true),
                    expected,
                    "prompt {prompt:?} gen {gen:?}"
                );
            }
        }
        for (st, _, text) in &reqs {
            assert_eq!(st.text(), text);
        }
    }
}

fn random_seqs(v: &Vocab, n: usize, seed: u64) -> Vec<(Vec<u32>, Vec<u32>)> {
    let size = v.tokenizer().get_vocab_size(true) as u64;
    let mut x = seed | 1;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    (0..n)
        .map(|_| {
            let p = (next() % 4) as usize;
            let g = (next() % 12) as usize + 1;
            let mut draw = |k| (0..k).map(|_| (next() % size) as u32).collect::<Vec<_>>();
            (draw(p), draw(g))
        })
        .collect()
}

#[test]
fn synthetic_vocabularies_match_the_crate() {
    for v in [spm_vocab(), byte_level_vocab()] {
        assert!(v.has_fast_decoder());
        assert!(v.self_check(3000, 8, 7).unwrap().is_empty());
        differential(&v, &random_seqs(&v, 400, 11));
    }
}

/// tokenizer.json files of the project's real vocabularies, when built (tools/*.py).
fn real_tokenizers() -> Vec<std::path::PathBuf> {
    let root = std::env::var("VLLM_MMRETRY_CACHE")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|_| std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(".cache"));
    let mut out = vec![];
    for sub in ["models", "tokenizers"] {
        if let Ok(rd) = std::fs::read_dir(root.join(sub)) {
            for e in rd.flatten() {
                let f = e.path().join("tokenizer.json");
                if f.exists() && !e.file_name().to_string_lossy().starts_with('.') {
                    out.push(f);
                }
            }
        }
    }
    out
}

#[test]
fn real_vocabularies_match_the_crate() {
    let files = real_tokenizers();
    // `make test-rust` builds both vocabularies first and sets this, so the test
    // cannot pass vacuously there; a bare `cargo test` just checks what exists.
    if std::env::var("VLLM_MMRETRY_REQUIRE_VOCABS").as_deref() == Ok("1") {
        assert!(
            files.len() >= 2,
            "expected the tiny-llava and Tekken vocabularies, found {files:?}"
        );
    }
    for f in files {
        let v = Arc::new(Vocab::from_file(f.to_str().unwrap()).unwrap());
        assert!(v.has_fast_decoder(), "{f:?}");
        let bad = v.self_check(5000, 10, 3).unwrap();
        assert!(bad.is_empty(), "{f:?}: {bad:?}");
        differential(&v, &random_seqs(&v, 200, 5));
    }
}
