use super::*;

/// A minimal msgpack writer for the tests.
#[derive(Default)]
struct W(Vec<u8>);

impl W {
    fn arr(mut self, n: usize) -> Self {
        if n < 16 {
            self.0.push(0x90 | n as u8);
        } else {
            self.0.push(0xdc);
            self.0.extend((n as u16).to_be_bytes());
        }
        self
    }
    fn nil(mut self) -> Self {
        self.0.push(0xc0);
        self
    }
    fn int(mut self, v: i64) -> Self {
        if (0..128).contains(&v) {
            self.0.push(v as u8);
        } else {
            self.0.push(0xd3);
            self.0.extend(v.to_be_bytes());
        }
        self
    }
    fn str(mut self, s: &str) -> Self {
        self.0.push(0xd9);
        self.0.push(s.len() as u8);
        self.0.extend(s.as_bytes());
        self
    }
    fn raw(mut self, b: &[u8]) -> Self {
        self.0.extend(b);
        self
    }
}

fn layout() -> Layout {
    use Kind::*;
    Layout {
        top_fields: 4,
        outputs_at: 1,
        output: vec![Str, IntList, Nil, OptEnum, OptIntOrStr, Int],
        output_required: 2,
    }
}

/// A message with one output, request "r", whose one token id is the raw value `id`.
fn one_token(id: &[u8]) -> Vec<u8> {
    let w = W::default().arr(2).int(0).arr(1).arr(2).str("r");
    w.arr(1).raw(id).0
}

fn one_output(w: W) -> W {
    w.arr(6)
        .str("r1")
        .arr(2)
        .int(7)
        .int(300)
        .nil()
        .int(1)
        .str("</s>")
        .int(0)
}

#[test]
fn reads_the_common_message() {
    let buf = one_output(W::default().arr(3).int(0).arr(1)).nil().0;
    let m = read(&layout(), &buf).unwrap();
    assert_eq!(m.top, vec![Some(&[0u8][..]), None, None]);
    assert_eq!(
        m.outputs,
        vec![vec![
            Val::Str("r1"),
            Val::Ints(vec![7, 300]),
            Val::Nil,
            Val::Int(1),
            Val::Str("</s>"),
            Val::Int(0)
        ]]
    );
}

#[test]
fn top_level_values_come_back_raw() {
    // A map (scheduler stats) and a float timestamp after the outputs.
    let stats = W::default().raw(&[0x81, 0xa1, b'a', 0x92, 0x01, 0xc3]).0;
    let ts = [0xcb, 0x3f, 0xf0, 0, 0, 0, 0, 0, 0];
    let buf = W::default().arr(4).int(2).arr(0).raw(&stats).raw(&ts).0;
    let m = read(&layout(), &buf).unwrap();
    assert_eq!(m.top[2], Some(&stats[..]));
    assert_eq!(m.top[3], Some(&ts[..]));
    assert!(m.outputs.is_empty());
}

#[test]
fn anything_uncommon_is_not_read() {
    let l = layout();
    let cases: Vec<Vec<u8>> = vec![
        // a non-nil value where only nil is read (logprobs)
        W::default()
            .arr(2)
            .int(0)
            .arr(1)
            .arr(3)
            .str("r")
            .arr(0)
            .int(5)
            .0,
        // a required field missing
        W::default().arr(2).int(0).arr(1).arr(1).str("r").0,
        // more output fields than declared
        {
            let w = W::default().arr(2).int(0).arr(1).arr(7).str("r").arr(0);
            w.nil().nil().nil().int(0).nil().0
        },
        // a negative finish reason
        W::default()
            .arr(2)
            .int(0)
            .arr(1)
            .arr(4)
            .str("r")
            .arr(0)
            .nil()
            .int(-1)
            .0,
        // a float token id
        one_token(&[0xca, 0, 0, 0, 0]),
        // a uint64 beyond i64
        one_token(&[0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff]),
        // bad UTF-8 in a request id
        W::default()
            .arr(2)
            .int(0)
            .arr(1)
            .arr(2)
            .raw(&[0xa1, 0xff])
            .arr(0)
            .0,
        // trailing bytes
        W::default().arr(1).int(0).int(1).0,
        // not an array
        W::default().nil().0,
        // the unused 0xc1 where a value is skipped
        W::default().arr(1).raw(&[0xc1]).0,
    ];
    for (i, buf) in cases.iter().enumerate() {
        assert!(read(&l, buf).is_none(), "case {i}");
    }
}

#[test]
fn truncated_or_lying_lengths_never_panic() {
    let full = one_output(W::default().arr(3).int(0).arr(1)).nil().0;
    for cut in 0..full.len() {
        assert!(read(&layout(), &full[..cut]).is_none(), "cut {cut}");
    }
    // Huge declared lengths, for the skipper and for the outputs.
    let lies: [&[u8]; 4] = [
        &[0x94, 0x00, 0x90, 0xdd, 0xff, 0xff, 0xff, 0xff],
        &[0x92, 0x00, 0xdd, 0xff, 0xff, 0xff, 0xff],
        &[0x93, 0x00, 0x90, 0xdf, 0xff, 0xff, 0xff, 0xff],
        &[0x93, 0x00, 0x90, 0xc9, 0xff, 0xff, 0xff, 0xff, 0x01],
    ];
    for b in lies {
        assert!(read(&layout(), b).is_none());
    }
}

#[test]
fn every_integer_width_reads_as_msgpack_says() {
    let ints: [(&[u8], i64); 9] = [
        (&[0x05], 5),
        (&[0xff], -1),
        (&[0xcc, 0xff], 255),
        (&[0xcd, 0x01, 0x00], 256),
        (&[0xce, 0xff, 0xff, 0xff, 0xff], 4_294_967_295),
        (&[0xd0, 0x80], -128),
        (&[0xd1, 0xff, 0x00], -256),
        (&[0xd2, 0x80, 0, 0, 0], i64::from(i32::MIN)),
        (
            &[0xd3, 0x7f, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff],
            i64::MAX,
        ),
    ];
    for (b, want) in ints {
        let buf = one_token(b);
        let m = read(&layout(), &buf).unwrap();
        assert_eq!(m.outputs[0][1], Val::Ints(vec![want]));
    }
}

/// More top-level fields than declared, with the outputs where they belong: only the
/// count refuses it.
#[test]
fn one_top_level_field_past_the_layout_is_not_read() {
    let l = layout();
    let fits = W::default().arr(4).int(0).arr(0).nil().nil().0;
    assert!(read(&l, &fits).is_some());
    let past = W::default().arr(5).int(0).arr(0).nil().nil().nil().0;
    assert!(read(&l, &past).is_none());
}
