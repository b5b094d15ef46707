//! Fingerprint version 2 over JSON values: the common case of `tokencapture.fingerprint`.
//!
//! Both hashes are SHA-256 over tagged, length-delimited UTF-8 fields
//! (`tag byte + u64 big-endian byte length + bytes`); SPEC section 4 and the Python module are
//! the definition. This port covers well-formed request items made of plain JSON values and
//! returns [`Unsupported`] for everything else, so the caller falls back to the Python
//! implementation, which either computes the same hash or raises the documented `ValueError`.
//! In particular it declines:
//!
//! * anything the Python code refuses (a non-dict item, an untyped block without text, a
//!   non-string identifier, malformed `tool_calls`), so errors are always Python's;
//! * a canonical JSON value that contains a float: orjson's float formatting (`1e+16`) is not
//!   serde_json's, and matching it digit for digit is not worth the risk;
//! * tool arguments that serde_json cannot parse (the Python rule then strips the string with
//!   Python's notion of whitespace, and "parses" is orjson's judgement, not serde_json's).
//!
//! Everything else, objects with sorted keys, strings, integers, booleans and null, serializes
//! byte for byte as orjson's `OPT_SORT_KEYS` does (compact, UTF-8, the same escapes).

use std::borrow::Cow;

use serde_json::{Map, Value};
use sha2::{Digest, Sha256};

const FINGERPRINT_DOMAIN: &[u8] = b"nemo-gym-lineage";
const CONTEXT_DOMAIN: &[u8] = b"nemo-gym-lineage-context";

/// Block types whose `text` is plain text ("" also covers a block without a type).
const TEXT_BLOCK_TYPES: [&str; 4] = ["", "text", "input_text", "output_text"];

/// This port does not decide the value: the Python implementation must.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Unsupported;

type Port<T> = Result<T, Unsupported>;

type Part<'a> = (Cow<'a, str>, Cow<'a, str>);
type Call<'a> = (&'a str, Cow<'a, str>, String);
type ToolResult<'a> = (&'a str, Cow<'a, str>);

static NULL: Value = Value::Null;

fn get<'a>(object: &'a Map<String, Value>, key: &str) -> &'a Value {
    object.get(key).unwrap_or(&NULL)
}

/// Python truthiness of a JSON value (`x or y` picks `y` when `x` is falsy).
fn truthy(value: &Value) -> bool {
    match value {
        Value::Null => false,
        Value::Bool(flag) => *flag,
        Value::Number(number) => number.as_f64() != Some(0.0),
        Value::String(text) => !text.is_empty(),
        Value::Array(items) => !items.is_empty(),
        Value::Object(members) => !members.is_empty(),
    }
}

fn or<'a>(first: &'a Value, second: &'a Value) -> &'a Value {
    if truthy(first) {
        first
    } else {
        second
    }
}

/// An identifier-like field: missing or falsy is "", a string is itself, anything else is
/// Python's `ValueError`.
fn text_of(value: &Value) -> Port<&str> {
    if !truthy(value) {
        return Ok("");
    }
    match value {
        Value::String(text) => Ok(text),
        _ => Err(Unsupported),
    }
}

fn contains_float(value: &Value) -> bool {
    match value {
        Value::Number(number) => number.is_f64(),
        Value::Array(items) => items.iter().any(contains_float),
        Value::Object(members) => members.values().any(contains_float),
        _ => false,
    }
}

/// `canonical_json`: compact JSON with sorted keys, for values without floats.
pub fn canonical_json(value: &Value) -> Port<String> {
    if contains_float(value) {
        return Err(Unsupported);
    }
    // `Map` is a BTreeMap (serde_json without `preserve_order`): keys come out sorted by
    // their UTF-8 bytes, which is code point order, which is orjson's OPT_SORT_KEYS order.
    serde_json::to_string(value).map_err(|_| Unsupported)
}

/// `canonicalize_tool_arguments`.
pub fn canonical_arguments(value: &Value) -> Port<String> {
    match value {
        Value::Null => Ok(String::new()),
        // Blank text is never JSON: Python strips it to "" (these are its whitespace chars).
        Value::String(text) if text.chars().all(is_python_space) => Ok(String::new()),
        Value::String(text) => {
            let parsed: Value = serde_json::from_str(text).map_err(|_| Unsupported)?;
            canonical_json(&parsed)
        }
        other => canonical_json(other),
    }
}

/// `str.isspace()` for one character: Unicode White_Space plus the four ASCII separators.
fn is_python_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

fn output_text(value: &Value) -> Port<Cow<'_, str>> {
    match value {
        Value::String(text) => Ok(Cow::Borrowed(text)),
        other => canonical_json(other).map(Cow::Owned),
    }
}

struct Content<'a> {
    parts: Vec<Part<'a>>,
    tool_uses: Vec<&'a Map<String, Value>>,
    tool_results: Vec<&'a Map<String, Value>>,
}

fn scan_content(content: &Value) -> Port<Content<'_>> {
    let mut out = Content {
        parts: Vec::new(),
        tool_uses: Vec::new(),
        tool_results: Vec::new(),
    };
    let blocks = match content {
        Value::Null => return Ok(out),
        Value::String(text) => {
            if !text.is_empty() {
                out.parts.push((Cow::Borrowed("text"), Cow::Borrowed(text)));
            }
            return Ok(out);
        }
        Value::Array(blocks) => blocks,
        _ => return Err(Unsupported),
    };
    for block in blocks {
        let block_map = match block {
            Value::String(text) => {
                if !text.is_empty() {
                    out.parts.push((Cow::Borrowed("text"), Cow::Borrowed(text)));
                }
                continue;
            }
            Value::Object(map) => map,
            _ => return Err(Unsupported),
        };
        let block_type = match get(block_map, "type") {
            Value::Null => "",
            Value::String(kind) => kind.as_str(),
            _ => return Err(Unsupported),
        };
        if block_type == "tool_use" {
            out.tool_uses.push(block_map);
            continue;
        }
        if block_type == "tool_result" {
            out.tool_results.push(block_map);
            continue;
        }
        match get(block_map, "text") {
            Value::String(text) if TEXT_BLOCK_TYPES.contains(&block_type) => {
                if !text.is_empty() {
                    out.parts.push((Cow::Borrowed("text"), Cow::Borrowed(text)));
                }
            }
            _ if !block_type.is_empty() => {
                out.parts.push((
                    Cow::Borrowed(block_type),
                    Cow::Owned(canonical_json(block)?),
                ));
            }
            _ => return Err(Unsupported),
        }
    }
    Ok(out)
}

fn tool_calls<'a>(
    message: &'a Map<String, Value>,
    tool_uses: &[&'a Map<String, Value>],
) -> Port<Vec<Call<'a>>> {
    let mut calls = Vec::new();
    if get(message, "type").as_str() == Some("function_call") {
        let name = text_of(get(message, "name"))?;
        let namespace = text_of(get(message, "namespace"))?;
        let name = if namespace.is_empty() {
            Cow::Borrowed(name)
        } else {
            Cow::Owned(format!("{namespace}__{name}"))
        };
        let call_id = text_of(or(get(message, "call_id"), get(message, "id")))?;
        calls.push((
            call_id,
            name,
            canonical_arguments(get(message, "arguments"))?,
        ));
    }
    for block in tool_uses {
        calls.push((
            text_of(get(block, "id"))?,
            Cow::Borrowed(text_of(get(block, "name"))?),
            canonical_arguments(get(block, "input"))?,
        ));
    }
    let listed = match get(message, "tool_calls") {
        Value::Null => return Ok(calls),
        Value::Array(listed) => listed,
        _ => return Err(Unsupported),
    };
    let empty = Map::new();
    for call in listed {
        let Value::Object(call) = call else {
            return Err(Unsupported);
        };
        let function = match get(call, "function") {
            Value::Null => &empty,
            Value::Object(function) => function,
            _ => return Err(Unsupported),
        };
        let arguments = canonical_arguments(get(function, "arguments"))?;
        // `empty` lives only in this frame: copy the (always empty) name out of it.
        let name = Cow::Owned(text_of(get(function, "name"))?.to_owned());
        calls.push((text_of(get(call, "id"))?, name, arguments));
    }
    Ok(calls)
}

fn tool_results<'a>(
    message: &'a Map<String, Value>,
    blocks: &[&'a Map<String, Value>],
) -> Port<Vec<ToolResult<'a>>> {
    let mut results = Vec::new();
    if get(message, "type").as_str() == Some("function_call_output") {
        let call_id = text_of(or(get(message, "call_id"), get(message, "id")))?;
        results.push((call_id, output_text(get(message, "output"))?));
    }
    if get(message, "role").as_str() == Some("tool") {
        let call_id = text_of(get(message, "tool_call_id"))?;
        results.push((call_id, output_text(get(message, "content"))?));
    }
    for block in blocks {
        let call_id = text_of(or(get(block, "tool_use_id"), get(block, "id")))?;
        results.push((call_id, output_text(get(block, "content"))?));
    }
    Ok(results)
}

fn feed(hasher: &mut Sha256, tag: u8, text: &str) {
    hasher.update([tag]);
    hasher.update((text.len() as u64).to_be_bytes());
    hasher.update(text.as_bytes());
}

fn item(value: &Value) -> Port<&Map<String, Value>> {
    value.as_object().ok_or(Unsupported)
}

/// `assistant_fingerprint(items)`: "" when no item is model-authored.
pub fn assistant_fingerprint<'a>(items: impl IntoIterator<Item = &'a Value>) -> Port<String> {
    let mut hasher = Sha256::new();
    hasher.update(FINGERPRINT_DOMAIN);
    let mut authored = false;
    for value in items {
        let message = item(value)?;
        if get(message, "role").as_str() != Some("assistant")
            && get(message, "type").as_str() != Some("function_call")
        {
            continue;
        }
        authored = true;
        let content = scan_content(get(message, "content"))?;
        for (kind, payload) in &content.parts {
            feed(&mut hasher, 0x00, kind);
            feed(&mut hasher, 0x01, payload);
        }
        for (id, name, arguments) in tool_calls(message, &content.tool_uses)? {
            feed(&mut hasher, 0x02, id);
            feed(&mut hasher, 0x03, &name);
            feed(&mut hasher, 0x04, &arguments);
        }
    }
    Ok(if authored {
        hex::encode(hasher.finalize())
    } else {
        String::new()
    })
}

/// Feed one item into a running `conversation_digest`.
fn digest_item(hasher: &mut Sha256, value: &Value) -> Port<()> {
    let message = item(value)?;
    feed(
        hasher,
        0x00,
        text_of(or(get(message, "role"), get(message, "type")))?,
    );
    let content = scan_content(get(message, "content"))?;
    for (kind, payload) in &content.parts {
        feed(hasher, 0x01, kind);
        feed(hasher, 0x02, payload);
    }
    for (id, name, arguments) in tool_calls(message, &content.tool_uses)? {
        feed(hasher, 0x03, id);
        feed(hasher, 0x04, &name);
        feed(hasher, 0x05, &arguments);
    }
    for (id, output) in tool_results(message, &content.tool_results)? {
        feed(hasher, 0x06, id);
        feed(hasher, 0x07, &output);
    }
    Ok(())
}

/// `conversation_digest(items)`.
pub fn conversation_digest<'a>(items: impl IntoIterator<Item = &'a Value>) -> Port<String> {
    let mut prefix = PrefixDigests::new();
    let items: Vec<&Value> = items.into_iter().collect();
    prefix.digest_of(&items, items.len())
}

/// `conversation_digest(items[:k])` for growing `k`, hashing each item once.
#[derive(Clone)]
pub struct PrefixDigests {
    hasher: Sha256,
    done: usize,
}

impl Default for PrefixDigests {
    fn default() -> Self {
        Self::new()
    }
}

impl PrefixDigests {
    pub fn new() -> Self {
        let mut hasher = Sha256::new();
        hasher.update(CONTEXT_DOMAIN);
        PrefixDigests { hasher, done: 0 }
    }

    /// The digest of `items[..k]`. Cheapest when called with non-decreasing `k`.
    pub fn digest_of<V: std::borrow::Borrow<Value>>(
        &mut self,
        items: &[V],
        k: usize,
    ) -> Port<String> {
        let k = k.min(items.len());
        if k < self.done {
            *self = PrefixDigests::new();
        }
        for value in &items[self.done..k] {
            digest_item(&mut self.hasher, value.borrow())?;
        }
        self.done = k;
        Ok(hex::encode(self.hasher.clone().finalize()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn golden() -> Option<Value> {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../shared/golden/fingerprints.json");
        let text = std::fs::read_to_string(path).ok()?;
        serde_json::from_str(&text).ok()
    }

    const DEFERRED: [&str; 2] = ["numbers_in_args", "chat_tool_calls_bad_json_args"];

    #[test]
    fn golden_vectors_match_or_defer() {
        let Some(golden) = golden() else {
            eprintln!("shared/golden not found; skipping");
            return;
        };
        let mut computed = 0;
        for vector in golden["vectors"].as_array().unwrap() {
            let name = vector["name"].as_str().unwrap();
            let messages = vector["messages"].as_array().unwrap();
            match assistant_fingerprint(messages) {
                Ok(fp) => {
                    assert_eq!(
                        fp,
                        vector["assistant_fingerprint"].as_str().unwrap(),
                        "{name}"
                    );
                    computed += 1;
                }
                // Only floats and non-JSON arguments defer among the golden vectors.
                Err(Unsupported) => assert!(DEFERRED.contains(&name), "{name}"),
            }
            match conversation_digest(messages) {
                Ok(digest) => {
                    assert_eq!(
                        digest,
                        vector["conversation_digest"].as_str().unwrap(),
                        "{name}"
                    )
                }
                Err(Unsupported) => assert!(DEFERRED.contains(&name), "{name}"),
            }
        }
        assert!(computed >= 15);
    }

    #[test]
    fn rejected_inputs_defer_to_python() {
        let Some(golden) = golden() else {
            return;
        };
        for vector in golden["rejected"].as_array().unwrap() {
            let messages = vector["messages"]
                .as_array()
                .cloned()
                .unwrap_or_else(|| vec![vector["messages"].clone()]);
            let fp = assistant_fingerprint(&messages);
            let digest = conversation_digest(&messages);
            assert!(
                fp.is_err() && digest.is_err(),
                "{}: the port must not hash what Python refuses",
                vector["name"]
            );
        }
    }

    #[test]
    fn prefix_digests_match_whole_digests() {
        let items: Vec<Value> = (0..6)
            .map(|i| serde_json::json!({"role": if i % 2 == 0 {"user"} else {"assistant"}, "content": format!("m{i}")}))
            .collect();
        let mut prefix = PrefixDigests::new();
        for k in [0, 1, 3, 3, 6, 2, 5] {
            assert_eq!(
                prefix.digest_of(&items, k).unwrap(),
                conversation_digest(&items[..k]).unwrap()
            );
        }
    }

    #[test]
    fn canonical_json_sorts_keys_and_escapes_like_orjson() {
        let value = serde_json::json!({"b": [1, true, null], "a": "\u{0}\u{1f}\u{7f}\"\\/é\n"});
        assert_eq!(
            canonical_json(&value).unwrap(),
            "{\"a\":\"\\u0000\\u001f\u{7f}\\\"\\\\/é\\n\",\"b\":[1,true,null]}"
        );
        assert_eq!(
            canonical_json(&serde_json::json!({"x": 1.5})),
            Err(Unsupported)
        );
        assert_eq!(
            canonical_arguments(&Value::String(" {\"b\":1, \"a\":[2]} ".into())).unwrap(),
            "{\"a\":[2],\"b\":1}"
        );
        assert_eq!(
            canonical_arguments(&Value::String("not json".into())),
            Err(Unsupported)
        );
        assert_eq!(canonical_arguments(&Value::Null).unwrap(), "");
        assert_eq!(
            canonical_arguments(&Value::String(" \u{1c}\t".into())).unwrap(),
            ""
        );
    }
}
