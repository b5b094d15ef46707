//! The properties the fuzz targets check, shared with `rust/tests/scanner_properties.rs`, which
//! runs them in every `cargo test` over generated inputs (this directory's libFuzzer targets
//! need a nightly toolchain and stay out of CI).

// Each fuzz target includes this file for one of the two properties.
#![allow(dead_code)]

use tokencapture::json::{extract_call_id, Repeats};
use tokencapture::log::{complete_lines, complete_prefix_len};

/// `extract_call_id` on arbitrary bytes as one log line: it must never panic; where
/// serde_json parses the same bytes as one JSON object the two must agree on the top-level
/// `model_call_id`; and bytes the parser refuses as JSON the scanner must refuse too (within
/// the limits both share).
pub fn call_id_agrees_with_a_parser(data: &[u8]) {
    let scanned = extract_call_id(data, None);
    // The scanner compares keys byte for byte, so only escape-free input is comparable with a
    // real parser (an escaped key like "model\u005fcall_id" is a different key to the scanner).
    // A repeated key is refused by the scanner while serde_json keeps the last one.
    let key = b"\"model_call_id\"";
    let mentions = data.windows(key.len()).filter(|w| *w == key).count();
    if data.contains(&b'\\') || mentions > 1 {
        return;
    }
    match serde_json::from_slice::<serde_json::Value>(data) {
        Ok(serde_json::Value::Object(object)) => match (object.get("model_call_id"), &scanned) {
            (Some(serde_json::Value::String(id)), Ok(found)) => assert_eq!(id, found),
            (Some(serde_json::Value::String(_)), Err(err)) => {
                panic!("valid record refused: {err:?}")
            }
            (_, Ok(found)) => panic!("scanner found {found:?} where the parser finds no string id"),
            (_, Err(_)) => {}
        },
        Ok(_) => assert!(scanned.is_err(), "scanner found an id outside an object"),
        // The parser also refuses what the scanner accepts on purpose: nesting past 128
        // levels, and numbers beyond f64's range (an exponent, or hundreds of digits).
        Err(_) if within_shared_limits(data) => assert!(
            scanned.is_err(),
            "scanner accepted bytes that are not JSON: {:?}",
            String::from_utf8_lossy(data)
        ),
        Err(_) => {}
    }
}

fn within_shared_limits(data: &[u8]) -> bool {
    let opened = data.iter().filter(|&&b| b == b'[' || b == b'{').count();
    let exponent = data
        .windows(2)
        .any(|pair| pair[0].is_ascii_digit() && matches!(pair[1], b'e' | b'E'));
    let long_number = data
        .split(|b| !b.is_ascii_digit())
        .any(|digits| digits.len() > 300);
    opened < 100 && !exponent && !long_number
}

/// The tail scan a reader runs over the bytes past the state index (`complete_lines` plus
/// `extract_call_id` on every line), at offset `base`: it must never panic, must yield
/// exactly the newline-terminated lines (in order, at their offsets, without newlines) and
/// leave out the torn tail after the last newline, and a walk carrying `Repeats` across the
/// lines must judge every line as a walk of that line alone does.
pub fn tail_scan_is_exact(base: u64, buf: &[u8]) {
    let prefix = complete_prefix_len(buf);
    assert!(prefix <= buf.len());
    assert!(prefix == 0 || buf[prefix - 1] == b'\n');
    assert!(
        !buf[prefix..].contains(&b'\n'),
        "a newline was left in the torn tail"
    );
    let mut rebuilt = Vec::with_capacity(prefix);
    let mut repeats = Repeats::new();
    for (offset, line) in complete_lines(buf, base) {
        assert_eq!(offset, base + rebuilt.len() as u64);
        assert!(!line.contains(&b'\n'));
        rebuilt.extend_from_slice(line);
        rebuilt.push(b'\n');
        // Either a record or an error the store turns into corruption; never a panic. Reusing
        // arrays of earlier lines (as the store's scan does) never changes the answer.
        let alone = extract_call_id(line, None);
        assert_eq!(extract_call_id(line, Some(&mut repeats)), alone);
    }
    assert_eq!(&rebuilt[..], &buf[..prefix]);
}
