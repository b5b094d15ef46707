//! `extract_call_id` on arbitrary bytes: it must never panic, and where serde_json can parse
//! the same bytes as one JSON object the two must agree on the top-level `model_call_id`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tokencapture::json::extract_call_id;

fuzz_target!(|data: &[u8]| {
    let scanned = extract_call_id(data, None);
    // The scanner compares keys byte for byte, so only escape-free input is comparable with a
    // real parser (an escaped key like "model\u005fcall_id" is a different key to the scanner).
    // A repeated key is refused by the scanner while serde_json keeps the last one.
    let key = b"\"model_call_id\"";
    let mentions = data.windows(key.len()).filter(|w| *w == key).count();
    if data.contains(&b'\\') || mentions > 1 {
        return;
    }
    let Ok(serde_json::Value::Object(object)) = serde_json::from_slice::<serde_json::Value>(data)
    else {
        return;
    };
    match (object.get("model_call_id"), &scanned) {
        (Some(serde_json::Value::String(id)), Ok(found)) => assert_eq!(id, found),
        (Some(serde_json::Value::String(_)), Err(err)) => panic!("valid record refused: {err:?}"),
        (_, Ok(found)) => panic!("scanner found {found:?} where the parser finds no string id"),
        (_, Err(_)) => {}
    }
});
