//! Fingerprint version 2 over JSON values: the common case of `tokencapture.fingerprint`.
//!
//! Both hashes are SHA-256 over tagged, length-delimited UTF-8 fields
//! (`tag byte + u64 big-endian byte length + bytes`); SPEC section 4 and the Python module are
//! the definition, and both reproduce NeMo Gym 0.7.0's values (docs/compat-fingerprints.md).
//! This port covers request items made of plain JSON values and returns [`Unsupported`] for
//! everything else, so the caller falls back to the Python implementation, which either
//! computes the same hash or raises. It returns a value only where it is certain of Python's,
//! and in particular it declines:
//!
//! * anything the Python code refuses (a non-dict item, an untyped block without text, a
//!   truthy non-dict tool call), so errors are always Python's;
//! * an identifier, role, type or name that Python renders with `str()` and that is not a
//!   string, `null`, a boolean or an integer (a float, a list, an object);
//! * a canonical JSON value that contains a float: orjson's float formatting (`1e+16`,
//!   `0.00001`) is neither serde_json's nor Python's `repr`;
//! * tool arguments that serde_json cannot parse or parses to a float. Python's `json` module
//!   decides what parses there (it accepts `NaN`, `Infinity`, `1e400`, escaped lone surrogates
//!   and integers of any size, which serde_json refuses or turns into floats), then orjson
//!   writes it (or refuses it); a string neither accepts is stripped with Python's notion of
//!   whitespace.
//!
//! Everything else, objects with sorted keys, strings, integers, booleans and null, serializes
//! byte for byte as orjson's `OPT_SORT_KEYS` does (compact, UTF-8, the same escapes), and
//! serde_json accepts exactly the integer, string and structure syntax Python's `json` does.

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
type Call<'a> = (Cow<'a, str>, Cow<'a, str>, String);
type ToolResult<'a> = (Cow<'a, str>, Cow<'a, str>);

static NULL: Value = Value::Null;
static EMPTY_MAP: std::sync::LazyLock<Map<String, Value>> = std::sync::LazyLock::new(Map::new);

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

/// Python's `str()` of a JSON scalar: a string is itself, `null` is "None", a boolean
/// "True"/"False", an integer its decimal digits. A float (Python's `repr` rules) or a
/// container (Python's `repr` of its items) is Python's to render.
fn py_str(value: &Value) -> Port<Cow<'_, str>> {
    match value {
        Value::String(text) => Ok(Cow::Borrowed(text)),
        Value::Null => Ok(Cow::Borrowed("None")),
        Value::Bool(true) => Ok(Cow::Borrowed("True")),
        Value::Bool(false) => Ok(Cow::Borrowed("False")),
        Value::Number(number) if !number.is_f64() => Ok(Cow::Owned(number.to_string())),
        _ => Err(Unsupported),
    }
}

/// An id, role or type (`str(x or "")`): missing or falsy is "", anything else `str()`.
fn text_of(value: &Value) -> Port<Cow<'_, str>> {
    if truthy(value) {
        py_str(value)
    } else {
        Ok(Cow::Borrowed(""))
    }
}

/// A tool name (`str(x.get("name", ""))`): missing is "", anything else `str()`, so a `null`
/// name is "None" and `false` is "False".
fn name_of(holder: &Map<String, Value>) -> Port<Cow<'_, str>> {
    match holder.get("name") {
        None => Ok(Cow::Borrowed("")),
        Some(name) => py_str(name),
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
        // `str(type or "")`; for JSON values it is "tool_use" exactly when the type is that
        // string, so this also picks the blocks Python's tool scan picks.
        let block_type = text_of(get(block_map, "type"))?;
        if block_type == "tool_use" {
            out.tool_uses.push(block_map);
            continue;
        }
        if block_type == "tool_result" {
            out.tool_results.push(block_map);
            continue;
        }
        match get(block_map, "text") {
            Value::String(text) if TEXT_BLOCK_TYPES.contains(&block_type.as_ref()) => {
                if !text.is_empty() {
                    out.parts.push((Cow::Borrowed("text"), Cow::Borrowed(text)));
                }
            }
            _ if !block_type.is_empty() => {
                out.parts
                    .push((block_type, Cow::Owned(canonical_json(block)?)));
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
        let name = name_of(message)?;
        let namespace = get(message, "namespace");
        let name = if truthy(namespace) {
            Cow::Owned(format!("{}__{name}", py_str(namespace)?))
        } else {
            name
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
            name_of(block)?,
            canonical_arguments(get(block, "input"))?,
        ));
    }
    // A falsy `tool_calls` (null, [], "", 0, false, {}) is no calls at all.
    let listed = match get(message, "tool_calls") {
        Value::Array(listed) => listed,
        other if !truthy(other) => return Ok(calls),
        _ => return Err(Unsupported),
    };
    for call in listed {
        // A falsy call or function reads as an empty one.
        let (call_id, function) = match call {
            Value::Object(call) => {
                let function = match get(call, "function") {
                    Value::Object(function) => function,
                    other if !truthy(other) => &*EMPTY_MAP,
                    _ => return Err(Unsupported),
                };
                (text_of(get(call, "id"))?, function)
            }
            other if !truthy(other) => (Cow::Borrowed(""), &*EMPTY_MAP),
            _ => return Err(Unsupported),
        };
        calls.push((
            call_id,
            name_of(function)?,
            canonical_arguments(get(function, "arguments"))?,
        ));
    }
    Ok(calls)
}

fn tool_results<'a>(
    message: &'a Map<String, Value>,
    blocks: &[&'a Map<String, Value>],
) -> Port<Vec<ToolResult<'a>>> {
    let mut results = Vec::new();
    // A Responses output, or else a chat tool message: an item that is both counts once.
    if get(message, "type").as_str() == Some("function_call_output") {
        let call_id = text_of(or(get(message, "call_id"), get(message, "id")))?;
        results.push((call_id, output_text(get(message, "output"))?));
    } else if get(message, "role").as_str() == Some("tool") {
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
            feed(&mut hasher, 0x02, &id);
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
        &text_of(or(get(message, "role"), get(message, "type")))?,
    );
    let content = scan_content(get(message, "content"))?;
    for (kind, payload) in &content.parts {
        feed(hasher, 0x01, kind);
        feed(hasher, 0x02, payload);
    }
    for (id, name, arguments) in tool_calls(message, &content.tool_uses)? {
        feed(hasher, 0x03, &id);
        feed(hasher, 0x04, &name);
        feed(hasher, 0x05, &arguments);
    }
    for (id, output) in tool_results(message, &content.tool_results)? {
        feed(hasher, 0x06, &id);
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

    /// SHA-256 of `domain` then each `(tag, text)` as tag + u64 BE length + UTF-8 bytes.
    fn expected(domain: &[u8], fields: &[(u8, &str)]) -> String {
        let mut hasher = Sha256::new();
        hasher.update(domain);
        for (tag, text) in fields {
            hasher.update([*tag]);
            hasher.update((text.len() as u64).to_be_bytes());
            hasher.update(text.as_bytes());
        }
        hex::encode(hasher.finalize())
    }

    #[test]
    fn scalar_identifiers_are_rendered_as_python_str_renders_them() {
        // NeMo Gym 0.7.0: names are `str(x.get("name", ""))` (null is "None"), ids, roles and
        // types `str(x or "")`; a falsy call or function reads as an empty one.
        let items = serde_json::json!([
            {"role": 7, "content": [{"type": true, "text": "x"}]},
            {"role": "assistant", "tool_calls": [
                {"id": 12, "function": {"name": null, "arguments": null}},
                null,
                {"id": 0, "function": {"name": false}},
                {"id": "c", "function": []},
                {"id": "d", "function": {"name": -3}},
            ]},
            {"type": "function_call", "call_id": true, "name": null, "namespace": 2},
            {"role": 0, "type": "function_call_output", "call_id": 0, "id": false, "output": 1},
        ]);
        let items = items.as_array().unwrap();
        let calls = [
            ("12", "None"),
            ("", ""),
            ("", "False"),
            ("c", ""),
            ("d", "-3"),
            ("True", "2__None"),
        ];
        let mut fp = Vec::new();
        for (id, name) in calls {
            fp.extend([(0x02, id), (0x03, name), (0x04, "")]);
        }
        assert_eq!(
            assistant_fingerprint(items).unwrap(),
            expected(FINGERPRINT_DOMAIN, &fp)
        );
        let mut ctx = vec![
            (0x00, "7"),
            (0x01, "True"),
            (0x02, "{\"text\":\"x\",\"type\":true}"),
            (0x00, "assistant"),
        ];
        for (id, name) in &calls[..5] {
            ctx.extend([(0x03, *id), (0x04, *name), (0x05, "")]);
        }
        ctx.extend([(0x00, "function_call"), (0x03, "True"), (0x04, "2__None")]);
        ctx.extend([
            (0x05, ""),
            (0x00, "function_call_output"),
            (0x06, ""),
            (0x07, "1"),
        ]);
        assert_eq!(
            conversation_digest(items).unwrap(),
            expected(CONTEXT_DOMAIN, &ctx)
        );
    }

    #[test]
    fn an_output_item_with_the_tool_role_is_one_result() {
        let items = serde_json::json!([
            {"role": "tool", "type": "function_call_output", "call_id": "c", "output": "o",
             "content": "x"}
        ]);
        let ctx = [
            (0x00, "tool"),
            (0x01, "text"),
            (0x02, "x"),
            (0x06, "c"),
            (0x07, "o"),
        ];
        assert_eq!(
            conversation_digest(items.as_array().unwrap()).unwrap(),
            expected(CONTEXT_DOMAIN, &ctx)
        );
    }

    #[test]
    fn what_python_renders_or_parses_differently_defers() {
        for item in [
            serde_json::json!({"role": 1.5}),
            serde_json::json!({"role": ["assistant"]}),
            serde_json::json!({"type": "function_call", "name": 2.0}),
            serde_json::json!({"type": "function_call", "name": {"a": 1}}),
            serde_json::json!({"role": "assistant", "tool_calls": "ab"}),
            serde_json::json!({"role": "assistant", "tool_calls": [{"function": "f"}]}),
            serde_json::json!({"role": "assistant", "tool_calls": [3]}),
            // Python's json module parses these; serde_json refuses them or reads a float.
            serde_json::json!({"type": "function_call", "arguments": "1e400"}),
            serde_json::json!({"type": "function_call", "arguments": "NaN"}),
            serde_json::json!({"type": "function_call", "arguments": "[-Infinity]"}),
            serde_json::json!({"type": "function_call", "arguments": "1".repeat(60)}),
            serde_json::json!({"type": "function_call", "arguments": "\"\\ud800\""}),
            serde_json::json!({"type": "function_call", "arguments": " \u{1c}[1] "}),
        ] {
            let items = [item];
            assert_eq!(conversation_digest(&items), Err(Unsupported), "{items:?}");
            // A user item's role is not part of the fingerprint, so it is answered there.
            let authored = items[0].get("role").is_none() || items[0]["role"] == "assistant";
            if authored {
                assert_eq!(assistant_fingerprint(&items), Err(Unsupported), "{items:?}");
            }
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
