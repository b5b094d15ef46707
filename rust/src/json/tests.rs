use super::*;

#[test]
fn extracts_the_top_level_call_id_only() {
    let line = br#"{"custom":{"model_call_id":"nested"},"model_call_id":"call-\"1\"","x":[1,2,{"y":"}"}],"f":-1.5e-3,"t":[true,false,null,0,"\u00e9\n"]}"#;
    assert_eq!(extract_call_id(line, None).unwrap(), "call-\"1\"");
    let unicode = r#"{"model_call_id":"caf\u00e9-é"}"#;
    assert_eq!(extract_call_id(unicode.as_bytes(), None).unwrap(), "café-é");
}

#[test]
fn refuses_what_is_not_one_record() {
    for bad in [
        &b""[..],
        b"   ",
        b"[1,2]",
        b"{\"model_call_id\":1}",
        b"{\"model_call_id\":\"a\"",
        b"{\"model_call_id\":\"a\"}}",
        b"{\"model_call_id\":\"a\"} x",
        b"{\"x\":[1,2}",
        b"{\"x\":\"unterminated}",
        b"{\"other\":1}",
        b"{\"model_call_id\":\"a\",\"model_call_id\":\"b\"}",
        b"\x00\x00\x00",
        b"{\"model_call_id\":\"a\\",
        b"{\"model_call_id\":\"a\",\"n\":01}",
        b"{\"model_call_id\":\"a\",\"n\":[1,]}",
        b"{\"model_call_id\":\"a\",\"n\":1x}",
        b"{\"model_call_id\":\"a\",\"n\":-}",
        b"{\"model_call_id\":\"a\",\"n\":1.}",
        b"{\"model_call_id\":\"a\",\"n\":tru}",
        b"{\"model_call_id\":\"a\",\"s\":\"\xff\"}",
        b"{\"model_call_id\":\"a\",\"s\":\"\x01\"}",
        b"{\"model_call_id\":\"a\",\"s\":\"\\x\"}",
        b"{\"model_call_id\":\"a\",\"s\":\"\\u12\"}",
        b"{\"model_call_id\":\"a\" \"b\":1}",
        b"{\"model_call_id\":\"a\",}",
        b"{\"model_call_id\":\"a\",\"o\":{1:2}}",
    ] {
        assert!(
            extract_call_id(bad, None).is_err(),
            "{:?}",
            String::from_utf8_lossy(bad)
        );
    }
}

/// Builds a compact re-serialization, to see the walk hands every value over in order, and
/// counts the integers it was handed one by one (the ones a repeat did not cover).
#[derive(Default)]
pub(crate) struct Echo {
    pub(crate) parsed_unsigned: usize,
}

impl Builder<'_> for Echo {
    type Value = String;
    type Items = Vec<String>;
    type Error = LineError;
    fn null(&mut self) -> Result<String, LineError> {
        Ok("null".into())
    }
    fn boolean(&mut self, value: bool) -> Result<String, LineError> {
        Ok(value.to_string())
    }
    fn unsigned(&mut self, value: u64, _: &[u8]) -> Result<String, LineError> {
        self.parsed_unsigned += 1;
        Ok(format!("i{value}"))
    }
    fn number(&mut self, text: &[u8], integer: bool) -> Result<String, LineError> {
        let text = String::from_utf8_lossy(text);
        Ok(if integer {
            format!("i{text}")
        } else {
            format!("f{text}")
        })
    }
    fn string(&mut self, raw: &[u8], escaped: bool) -> Result<String, LineError> {
        Ok(format!(
            "{}{}",
            if escaped { "e" } else { "" },
            String::from_utf8_lossy(raw)
        ))
    }
    fn items(&mut self) -> Result<Vec<String>, LineError> {
        Ok(Vec::new())
    }
    fn push(&mut self, items: &mut Vec<String>, item: String) -> Result<(), LineError> {
        items.push(item);
        Ok(())
    }
    fn reuse(
        &mut self,
        items: &mut Vec<String>,
        earlier: &String,
        count: usize,
    ) -> Result<(), LineError> {
        let inner = earlier
            .strip_prefix("u[")
            .and_then(|rest| rest.strip_suffix(']'))
            .expect("only unsigned arrays are remembered");
        items.extend(inner.split(',').take(count).map(str::to_owned));
        Ok(())
    }
    fn array(&mut self, items: Vec<String>, all_unsigned: bool) -> Result<String, LineError> {
        let mark = if all_unsigned { "u" } else { "" };
        Ok(format!("{mark}[{}]", items.join(",")))
    }
    fn object(&mut self, members: Vec<(String, String)>, _: usize) -> Result<String, LineError> {
        let members: Vec<String> = members
            .into_iter()
            .map(|(k, v)| format!("{k}:{v}"))
            .collect();
        Ok(format!("{{{}}}", members.join(",")))
    }
}

#[test]
fn build_hands_every_value_to_the_builder() {
    let line = br#" {"a": [1, -2.5e3, true, null, "x\ny"], "b": {}} "#;
    assert_eq!(
        build(line, &mut Echo::default(), None).unwrap(),
        r#"{"a":[i1,f-2.5e3,true,null,e"x\ny"],"b":{}}"#
    );
    assert!(build(b"[1] 2", &mut Echo::default(), None).is_err());
    assert!(build(b"[01]", &mut Validate, None).is_err());
}

fn ids(range: std::ops::Range<u64>) -> String {
    range
        .map(|i| (i * 7919 % 100_000).to_string())
        .collect::<Vec<_>>()
        .join(",")
}

#[test]
fn repeated_prompt_and_answer_are_reused_not_parsed() {
    // Turn 2's prompt is turn 1's prompt, turn 1's answer, then new tokens.
    let (prompt, answer, new) = (ids(0..300), ids(300..400), ids(400..450));
    let first = format!(r#"{{"g":[{answer}],"p":[{prompt}]}}"#);
    let second = format!(
        r#"{{"g":[{}],"p":[{prompt},{answer},{new}]}}"#,
        ids(450..460)
    );
    let mut echo = Echo::default();
    let mut repeats = Repeats::new();
    build(first.as_bytes(), &mut echo, Some(&mut repeats)).unwrap();
    assert_eq!(echo.parsed_unsigned, 400);
    let reused = build(second.as_bytes(), &mut echo, Some(&mut repeats)).unwrap();
    assert_eq!(
        echo.parsed_unsigned,
        400 + 10 + 50,
        "only the new ids are parsed"
    );
    assert_eq!(
        reused,
        build(second.as_bytes(), &mut Echo::default(), None).unwrap()
    );
}

#[test]
fn a_repeat_never_swallows_a_longer_number_or_a_broken_line() {
    let base = ids(0..100);
    let first = format!("[{base}]");
    // The last item continues ("...5" then "...57"): it must be parsed, not reused.
    let longer = format!("[{base}7]");
    let mut echo = Echo::default();
    let mut echo_repeats = Repeats::new();
    build(first.as_bytes(), &mut echo, Some(&mut echo_repeats)).unwrap();
    assert_eq!(
        build(longer.as_bytes(), &mut echo, Some(&mut echo_repeats)).unwrap(),
        build(longer.as_bytes(), &mut Echo::default(), None).unwrap()
    );
    // Whatever follows a reused run is still checked.
    for bad in [
        format!("[{base},01]"),
        format!("[{base},]"),
        format!("[{base}"),
        format!("[{base}.]"),
        format!("[{base}e]"),
        format!("[{base} 1]"),
        format!("[{base},1.5e]"),
    ] {
        let mut repeats = Repeats::new();
        build(first.as_bytes(), &mut Validate, Some(&mut repeats)).unwrap();
        assert!(
            build(bad.as_bytes(), &mut Validate, Some(&mut repeats)).is_err(),
            "{bad}"
        );
        assert!(build(bad.as_bytes(), &mut Validate, None).is_err(), "{bad}");
    }
}

/// A tiny deterministic generator, so the comparison below covers many shapes reproducibly.
/// A small deterministic generator for randomized tests.
pub(crate) struct Lcg(pub(crate) u64);

impl Lcg {
    pub(crate) fn next(&mut self, below: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 33) % below
    }
}

/// Six lines whose arrays repeat pieces of earlier ones (whole or cut anywhere, even
/// mid-number), with fresh numbers, now and then a non-integer item or an item that continues
/// (which can break the line), in random order.
fn random_lines(rng: &mut Lcg) -> Vec<String> {
    let mut history: Vec<Vec<String>> = Vec::new();
    let mut lines = Vec::new();
    for _ in 0..6 {
        let mut items: Vec<String> = Vec::new();
        if !history.is_empty() && rng.next(2) == 0 {
            // Most often an array starts by repeating an earlier one (a growing prompt).
            let earlier = &history[rng.next(history.len() as u64) as usize];
            items.extend(earlier.iter().cloned());
        }
        for _ in 0..rng.next(4) {
            match (rng.next(5), history.len()) {
                (0..=2, n) if n > 0 => {
                    let earlier = &history[rng.next(n as u64) as usize];
                    let take = rng.next(earlier.len() as u64 + 1) as usize;
                    items.extend(earlier[..take].iter().cloned());
                }
                (3, _) => items.push(
                    ["1.5", "-2", "0", "\"s\"", "[1,2]", "12e3"][rng.next(6) as usize].into(),
                ),
                _ => items.extend((0..rng.next(120)).map(|_| rng.next(1_000_000).to_string())),
            }
        }
        if rng.next(4) == 0 {
            if let Some(last) = items.last_mut() {
                last.push(char::from(b'0' + rng.next(10) as u8)); // an item that continues
            }
        }
        let separator = if rng.next(6) == 0 { ", " } else { "," };
        lines.push(format!(r#"{{"a":[{}],"b":[]}}"#, items.join(separator)));
        history.push(items);
    }
    lines
}

#[test]
fn walks_with_and_without_repeats_agree() {
    let mut rng = Lcg(7);
    let (mut parsed_alone, mut parsed_repeating) = (0, 0);
    for _ in 0..200 {
        let lines = random_lines(&mut rng);
        // One walk over the lines, as a reader walks a log, against each line walked alone.
        let mut echo = Echo::default();
        let mut repeats = Repeats::new();
        let mut validate_repeats = Repeats::new();
        for line in &lines {
            let mut alone = Echo::default();
            let expected = build(line.as_bytes(), &mut alone, None);
            parsed_alone += alone.parsed_unsigned;
            assert_eq!(
                build(line.as_bytes(), &mut echo, Some(&mut repeats)),
                expected,
                "{line}"
            );
            assert_eq!(
                build(line.as_bytes(), &mut Validate, Some(&mut validate_repeats)).is_ok(),
                expected.is_ok()
            );
        }
        parsed_repeating += echo.parsed_unsigned;
    }
    // Some arrays are too short or mixed to be remembered; a good share must still be reused.
    assert!(
        parsed_repeating * 5 < parsed_alone * 4,
        "repeats were rarely taken: {parsed_repeating} of {parsed_alone} ids parsed"
    );
}

/// `lines` walked as a log two ways: one walk (with repeats), and tapes replayed (their floats
/// left as text with `floats_as_text`). Returns each way's results and its builder.
fn direct_and_replayed(
    lines: &[String],
    floats_as_text: bool,
) -> [(Vec<Result<String, LineError>>, Echo); 2] {
    use super::tape::{LineTaper, Replay};
    let buf = lines.join("\n");
    let mut ranges = Vec::new();
    let mut start = 0;
    for line in lines {
        ranges.push(start..start + line.len());
        start += line.len() + 1;
    }
    let mut direct = Echo::default();
    let mut repeats = Repeats::new();
    let expected = lines
        .iter()
        .map(|line| build(line.as_bytes(), &mut direct, Some(&mut repeats)))
        .collect();
    let mut replayed = Echo::default();
    let mut replay = Replay::new();
    let mut got = Vec::new();
    let mut taper = LineTaper::new();
    taper.floats_as_text(floats_as_text);
    for range in ranges {
        let bytes = &buf.as_bytes()[range];
        assert_eq!(bytes, lines[got.len()].as_bytes());
        let taped = taper.tape(bytes);
        got.push(taped.and_then(|tape| replay.value(&tape, bytes, &mut replayed)));
    }
    [(expected, direct), (got, replayed)]
}

#[test]
fn replayed_tapes_make_the_calls_of_a_direct_walk() {
    let mut rng = Lcg(11);
    let (mut failed_lines, mut compared_counts) = (0, 0);
    for round in 0..300 {
        let lines = random_lines(&mut rng);
        let [(expected, direct), (got, replayed)] = direct_and_replayed(&lines, round % 2 == 1);
        assert_eq!(got, expected, "{lines:?}");
        let failures = expected.iter().filter(|line| line.is_err()).count();
        failed_lines += failures;
        if failures == 0 {
            // The same arrays were reused: the same ids were handed over one by one.
            assert_eq!(replayed.parsed_unsigned, direct.parsed_unsigned);
            compared_counts += 1;
        }
    }
    assert!(
        failed_lines > 0 && compared_counts > 100,
        "{failed_lines} {compared_counts}"
    );
}

#[test]
fn a_walk_stops_when_its_consumer_does() {
    use super::tape::tape_lines;
    let buf = b"[1]\n[2]\n[3]";
    let mut seen = 0;
    tape_lines(buf, &[0..3, 4..7, 8..11], |_| {
        seen += 1;
        seen < 2
    });
    assert_eq!(seen, 2);
}

#[test]
fn arrays_of_a_broken_line_are_never_reused_by_a_replay() {
    let prompt = ids(0..200);
    // The first line's array is complete (a direct walk remembers it) before the line breaks.
    let lines = [
        format!(r#"{{"a":[{prompt}],"b":tru}}"#),
        format!(r#"{{"a":[{prompt},7]}}"#),
    ];
    let [(expected, _), (got, _)] = direct_and_replayed(&lines, false);
    assert!(expected[0].is_err() && expected[1].is_ok());
    assert_eq!(got, expected);
}

#[test]
fn a_tape_gives_the_call_id_verdicts_of_the_call_id_walk() {
    use super::tape::{call_id_of, LineTaper};
    let mut rng = Lcg(5);
    let (mut found, mut refused) = (0, 0);
    for _ in 0..200 {
        // Entry-like lines around random arrays, some broken; the taper and the walk each
        // carry their repeats across the lines, as the verifying thread does.
        let mut lines = random_lines(&mut rng);
        let ids = [
            r#""model_call_id":"c1","#,
            r#""model_call_id":"c\u00e9\n","#,
            r#""model_call_id":7,"#,
            r#""model_call_id":"a","model_call_id":"a","#,
            r#""model_call_id":"bad\q","#,
            "",
        ];
        for line in &mut lines {
            let id = ids[rng.next(ids.len() as u64) as usize];
            *line = match rng.next(8) {
                0 => format!("[{line}]"),
                1 => format!("{line} x"),
                _ => line.replacen('{', &format!("{{{id}"), 1),
            };
        }
        let mut taper = LineTaper::new();
        let mut repeats = Repeats::new();
        for line in &lines {
            let walked = extract_call_id(line.as_bytes(), Some(&mut repeats));
            let taped = call_id_of(line.as_bytes(), &taper.tape(line.as_bytes()));
            // The same call id, or the same refusal in the same words.
            assert_eq!(taped, walked, "{line}");
            if walked.is_ok() {
                found += 1;
            } else {
                refused += 1;
            }
        }
    }
    assert!(found > 200 && refused > 200, "{found} {refused}");
}
