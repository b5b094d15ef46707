//! Columnar snapshots: a rollout's entries as column buffers, decoded straight from the
//! verified log bytes.
//!
//! [`freeze_columns`] and [`read_columns`] are [`Store::freeze_decoding`] and
//! [`Store::read_decoding`] with another decoder target: [`ColumnBuilder`] turns each line into
//! one row, writing the token ids and log-probs of every entry into three flat buffers (one per
//! token field) with no value per token, and keeping the other fields as scalars or JSON text.
//! The buffers have Arrow's list layout (values plus offsets), so the binding hands them to
//! Arrow arrays without a copy. Everything freeze decides (the fence, the digests, the folded
//! tail, the incomplete flag, the snapshot id and version) comes from the same store call.
//!
//! **Where the token arrays go.** The walk hands a builder an array's items before the object
//! that holds them, but it hands over an object's key just before the key's value. So an array
//! that starts right after the key `"prompt_token_ids"` (or the other two token fields) and is
//! not inside another array is a *candidate*: its items go straight into that field's buffer. A
//! candidate that meets an item of another kind (or an id beyond int64) is given up: the items
//! it wrote stay in the buffer, unused, and the array is kept as ordinary values. So does a
//! candidate that turns out to sit in a nested object. The rows remember which part of each
//! buffer is theirs; when the records of a snapshot do not cover their buffer exactly, in order
//! (such leftovers, a duplicate line), the records' parts are copied into a fresh buffer.
//! Repeated arrays (`json::Repeats`) are copied from the earlier row's part of the buffer;
//! with `shared_prefixes`, a prompt repeating the whole prompt that ends the prompt buffer
//! starts where that one does instead (its rows' ranges overlap), and the prompt column is
//! handed over as a list view (offsets and sizes) of the buffer as it is.
//!
//! **Validation.** A row is checked with the rules freeze applies to a decoded record (the
//! types of `TokenEntry`'s fields and its invariants). A line that breaks them makes the
//! whole read fail with a [`RecordError`], as freeze fails; the Python layer then asks the
//! object freeze for its exact refusal. Values a `TokenEntry` can hold but the columns cannot
//! (a token id or an int field beyond int64) are refused the same way.

use std::borrow::Cow;
use std::fmt::Write as _;
use std::ops::Range;
use std::rc::Rc;

use crate::error::Error;
use crate::json::tape::{Replay, TapeFeed};
use crate::json::{self, Builder, LineError, Repeats};
use crate::store::{LinesToDecode, Records, Store};

/// One value of a line as the columnar decoder holds it. Texts borrow the log buffer.
#[derive(Debug, Clone)]
pub enum Col<'a> {
    Null,
    Bool(bool),
    /// A plain non-negative integer.
    UInt(u64),
    /// Any other integer (negative, or beyond 64 bits): its text.
    Int(&'a [u8]),
    /// A number with a fraction or an exponent, and its text when the line gave it.
    Float(f64, Option<&'a [u8]>),
    /// A string with its quotes, and whether it holds an escape.
    Str(&'a [u8], bool),
    /// Items of one of the id buffers: `(field, start, len)`.
    Ids(IdField, usize, usize),
    /// Items of the log-prob buffer: `(start, len)`.
    Probs(usize, usize),
    Array(Rc<Vec<Col<'a>>>),
    Object(Rc<Vec<(Col<'a>, Col<'a>)>>),
}

/// The two token-id fields.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IdField {
    Prompt = 0,
    Generation = 1,
}

/// Where the items of an array being walked go.
#[derive(Debug, Clone, Copy)]
enum Target {
    /// Kept as values.
    Values,
    /// Into an id buffer, from this position.
    Ids(IdField, usize),
    /// Into the log-prob buffer, from this position.
    Probs(usize),
}

/// An array of a [`ColumnBuilder`] while its items are walked.
pub struct ColItems<'a> {
    target: Target,
    values: Vec<Col<'a>>,
}

/// The token fields a key names, spelled as the canonical line spells them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TokenKey {
    Ids(IdField),
    Probs,
}

fn token_key(raw: &[u8]) -> Option<TokenKey> {
    match raw {
        b"\"prompt_token_ids\"" => Some(TokenKey::Ids(IdField::Prompt)),
        b"\"generation_token_ids\"" => Some(TokenKey::Ids(IdField::Generation)),
        b"\"generation_log_probs\"" => Some(TokenKey::Probs),
        _ => None,
    }
}

/// Why a record cannot be a row: its line is not a valid entry, or it holds a value the
/// columns cannot (the message says which).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordError {
    /// Byte offset of the record's line in the log.
    pub offset: u64,
    pub message: String,
}

/// The JSON text of a value (see `render`).
pub type JsonText = String;

/// Every field of one entry but the token arrays, which are ranges of the buffers.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    pub schema_version: i64,
    pub rollout_id: String,
    pub model_call_id: String,
    pub model: String,
    pub prompt_token_ids: Range<usize>,
    pub generation_token_ids: Range<usize>,
    pub generation_log_probs: Range<usize>,
    /// None for JSON null.
    pub routed_experts: Option<JsonText>,
    pub output_items: JsonText,
    pub token_item_index: Option<i64>,
    pub response_id: Option<String>,
    pub created_at: f64,
    pub parent_call_id: Option<String>,
    pub cum_len: Option<i64>,
    pub digest: Option<String>,
    pub parent_resolution: Option<String>,
    pub continuation_fingerprint: String,
    pub continuation_context_len: i64,
    pub continuation_context_digest: String,
    pub parent_resolution_reason: String,
    pub fingerprint_version: Option<i64>,
    pub prompt_is_delta: bool,
    pub prefix_requested: bool,
    pub prefix_supplied: bool,
    /// The fields `TokenEntry` does not declare, as one JSON object; None when there are none.
    pub extras: Option<JsonText>,
}

/// The decoder target; see the module documentation.
#[derive(Default)]
pub struct ColumnBuilder {
    ids: [Vec<i64>; 2],
    probs: Vec<f64>,
    /// The token field the last string names, if it was one (a key, when an array follows).
    last_key: Option<TokenKey>,
    /// How many arrays enclose the walk's position.
    array_depth: usize,
    /// The line's first problem found while building (an escaped string that is not text).
    line_error: Option<String>,
    /// The line's row, once its top-level object is built.
    row: Option<Result<Row, String>>,
    /// Point a prompt that extends the previous prompt at that prompt's ids instead of
    /// copying them (the prompt column becomes a list view; see [`decode_columns`]).
    shared_prefixes: bool,
}

impl ColumnBuilder {
    fn start_line(&mut self) {
        self.last_key = None;
        self.array_depth = 0;
        self.line_error = None;
        self.row = None;
    }

    /// The row of the line just walked, or why it is not one.
    fn finish_line(&mut self, walked: Result<(), String>) -> Result<Row, String> {
        walked?;
        self.row
            .take()
            .unwrap_or_else(|| Err("expected a JSON object".to_owned()))
    }

    /// Give up a candidate array: its items so far become values.
    fn to_values<'a>(&self, items: &mut ColItems<'a>) {
        match items.target {
            Target::Values => {}
            Target::Ids(field, start) => {
                let written = &self.ids[field as usize][start..];
                items.values = written.iter().map(|&id| Col::UInt(id as u64)).collect();
            }
            Target::Probs(start) => {
                let written = &self.probs[start..];
                items.values = written.iter().map(|&p| Col::Float(p, None)).collect();
            }
        }
        items.target = Target::Values;
    }

    /// The first `count` items of `earlier` (an array of unsigned integers) as values; None
    /// if it has fewer (the walk never asks for more than it remembered).
    fn values_of<'a>(&self, earlier: &Col<'a>, count: usize) -> Option<Vec<Col<'a>>> {
        match *earlier {
            Col::Ids(field, start, len) if count <= len => Some(
                self.ids[field as usize][start..start + count]
                    .iter()
                    .map(|&id| Col::UInt(id as u64))
                    .collect(),
            ),
            Col::Array(ref items) => items.get(..count).map(<[Col<'a>]>::to_vec),
            _ => None,
        }
    }

    fn ids_of(&self, value: &Col<'_>) -> Option<&[i64]> {
        match *value {
            Col::Ids(field, start, len) => Some(&self.ids[field as usize][start..start + len]),
            _ => None,
        }
    }
}

/// A float the walk met: it checked the grammar, so the text is ASCII and parses (possibly to
/// ±inf).
fn parse_walked_float(text: &[u8]) -> Result<f64, LineError> {
    std::str::from_utf8(text)
        .ok()
        .and_then(|text| text.parse::<f64>().ok())
        .ok_or_else(|| LineError("invalid float".to_owned()))
}

fn decode_text<'t>(raw: &'t [u8], escaped: bool) -> Result<Cow<'t, str>, String> {
    if escaped {
        serde_json::from_slice::<String>(raw)
            .map(Cow::Owned)
            .map_err(|err| err.to_string())
    } else {
        std::str::from_utf8(&raw[1..raw.len() - 1])
            .map(Cow::Borrowed)
            .map_err(|err| err.to_string())
    }
}

impl<'a> Builder<'a> for ColumnBuilder {
    type Value = Col<'a>;
    type Items = ColItems<'a>;
    type Error = LineError;

    fn null(&mut self) -> Result<Col<'a>, LineError> {
        self.last_key = None;
        Ok(Col::Null)
    }

    fn boolean(&mut self, value: bool) -> Result<Col<'a>, LineError> {
        self.last_key = None;
        Ok(Col::Bool(value))
    }

    fn unsigned(&mut self, value: u64, _: &'a [u8]) -> Result<Col<'a>, LineError> {
        self.last_key = None;
        Ok(Col::UInt(value))
    }

    fn number(&mut self, text: &'a [u8], integer: bool) -> Result<Col<'a>, LineError> {
        self.last_key = None;
        if integer {
            // The walk hands plain non-negative integers to `unsigned`; a replay hands over
            // those it parsed, so parse the rest that fit here the same way.
            return Ok(
                match std::str::from_utf8(text).ok().and_then(|t| t.parse().ok()) {
                    Some(value) => Col::UInt(value),
                    None => Col::Int(text),
                },
            );
        }
        Ok(Col::Float(parse_walked_float(text)?, Some(text)))
    }

    fn float(&mut self, value: f64, text: &'a [u8]) -> Result<Col<'a>, LineError> {
        self.last_key = None;
        Ok(Col::Float(value, Some(text)))
    }

    fn string(&mut self, raw: &'a [u8], escaped: bool) -> Result<Col<'a>, LineError> {
        if escaped {
            // Freeze decodes every string; one JSON allows but text cannot hold (a lone
            // surrogate) fails it there, so it fails the line here too.
            if let Err(err) = serde_json::from_slice::<String>(raw) {
                self.line_error.get_or_insert_with(|| err.to_string());
            }
            self.last_key = None;
        } else {
            self.last_key = token_key(raw);
        }
        Ok(Col::Str(raw, escaped))
    }

    fn items(&mut self) -> Result<ColItems<'a>, LineError> {
        let key = self.last_key.take();
        let target = match key {
            _ if self.array_depth > 0 => Target::Values,
            Some(TokenKey::Ids(field)) => Target::Ids(field, self.ids[field as usize].len()),
            Some(TokenKey::Probs) => Target::Probs(self.probs.len()),
            None => Target::Values,
        };
        self.array_depth += 1;
        Ok(ColItems {
            target,
            values: Vec::new(),
        })
    }

    fn push(&mut self, items: &mut ColItems<'a>, item: Col<'a>) -> Result<(), LineError> {
        match (items.target, &item) {
            (Target::Ids(field, _), &Col::UInt(id)) if i64::try_from(id).is_ok() => {
                self.ids[field as usize].push(id as i64);
                return Ok(());
            }
            (Target::Probs(_), &Col::Float(value, _)) => {
                self.probs.push(value);
                return Ok(());
            }
            (Target::Values, _) => {}
            _ => self.to_values(items),
        }
        items.values.push(item);
        Ok(())
    }

    fn push_unsigned_run(
        &mut self,
        items: &mut ColItems<'a>,
        values: &[u64],
        text: impl Fn(usize) -> &'a [u8],
    ) -> Result<(), LineError> {
        if let Target::Ids(field, _) = items.target {
            if values.iter().all(|&id| i64::try_from(id).is_ok()) {
                self.last_key = None;
                let ids = &mut self.ids[field as usize];
                ids.extend(values.iter().map(|&id| id as i64));
                return Ok(());
            }
        }
        json::push_each(self, items, values.len(), |b, i| {
            b.unsigned(values[i], text(i))
        })
    }

    fn push_float_run(
        &mut self,
        items: &mut ColItems<'a>,
        values: &[f64],
        text: impl Fn(usize) -> &'a [u8],
    ) -> Result<(), LineError> {
        if let Target::Probs(_) = items.target {
            self.last_key = None;
            self.probs.extend_from_slice(values);
            return Ok(());
        }
        json::push_each(self, items, values.len(), |b, i| {
            b.float(values[i], text(i))
        })
    }

    fn push_float_text_run(
        &mut self,
        items: &mut ColItems<'a>,
        count: usize,
        text: impl Fn(usize) -> &'a [u8],
    ) -> Result<(), LineError> {
        if let Target::Probs(_) = items.target {
            self.last_key = None;
            self.probs.reserve(count);
            for i in 0..count {
                self.probs.push(parse_walked_float(text(i))?);
            }
            return Ok(());
        }
        json::push_each(self, items, count, |b, i| b.number(text(i), false))
    }

    fn reuse(
        &mut self,
        items: &mut ColItems<'a>,
        earlier: &Col<'a>,
        count: usize,
    ) -> Result<(), LineError> {
        if let (Target::Ids(field, at), &Col::Ids(source, start, len)) = (items.target, earlier) {
            let buffer_end = self.ids[field as usize].len();
            if self.shared_prefixes
                && field == IdField::Prompt
                && source == field
                && count == len
                && at == buffer_end
                && start + len == buffer_end
            {
                // The array begins with the whole of the array that ends the buffer, and
                // nothing of it is written yet: it starts where that one does, sharing its ids.
                items.target = Target::Ids(field, start);
                return Ok(());
            }
            if count <= len {
                let run = start..start + count;
                if field == source {
                    self.ids[field as usize].extend_from_within(run);
                } else {
                    let [prompt, generation] = &mut self.ids;
                    match field {
                        IdField::Prompt => prompt.extend_from_slice(&generation[run]),
                        IdField::Generation => generation.extend_from_slice(&prompt[run]),
                    }
                }
                return Ok(());
            }
        }
        self.to_values(items);
        let Some(mut run) = self.values_of(earlier, count) else {
            return Err(LineError("a repeated array was not built".to_owned()));
        };
        items.values.append(&mut run);
        Ok(())
    }

    fn array(&mut self, items: ColItems<'a>, _all_unsigned: bool) -> Result<Col<'a>, LineError> {
        self.last_key = None;
        self.array_depth = self.array_depth.saturating_sub(1);
        Ok(match items.target {
            Target::Ids(field, start) => {
                Col::Ids(field, start, self.ids[field as usize].len() - start)
            }
            Target::Probs(start) => Col::Probs(start, self.probs.len() - start),
            Target::Values => Col::Array(Rc::new(items.values)),
        })
    }

    fn object(
        &mut self,
        members: Vec<(Col<'a>, Col<'a>)>,
        depth: usize,
    ) -> Result<Col<'a>, LineError> {
        self.last_key = None;
        if depth != 1 {
            return Ok(Col::Object(Rc::new(members)));
        }
        let row = match self.line_error.take() {
            Some(err) => Err(err),
            None => self.record(&members),
        };
        self.row = Some(row);
        Ok(Col::Null)
    }
}

// ---- rows ------------------------------------------------------------------------------------

/// `TokenEntry`'s required fields.
const REQUIRED: [&str; 5] = [
    "rollout_id",
    "model_call_id",
    "prompt_token_ids",
    "generation_token_ids",
    "generation_log_probs",
];

/// `TokenEntry`'s declared fields; any other key is an extra.
const DECLARED: [&str; 24] = [
    "schema_version",
    "rollout_id",
    "model_call_id",
    "model",
    "prompt_token_ids",
    "generation_token_ids",
    "generation_log_probs",
    "routed_experts",
    "output_items",
    "token_item_index",
    "response_id",
    "created_at",
    "parent_call_id",
    "cum_len",
    "digest",
    "parent_resolution",
    "continuation_fingerprint",
    "continuation_context_len",
    "continuation_context_digest",
    "parent_resolution_reason",
    "fingerprint_version",
    "prompt_is_delta",
    "prefix_requested",
    "prefix_supplied",
];

const STATUSES: [&str; 3] = ["resolved", "root", "unresolved"];

/// The members of one record by name (the last of a repeated key wins, as in a dict), with
/// the raw key of each extra.
struct Fields<'r, 'a> {
    declared: [Option<&'r Col<'a>>; DECLARED.len()],
    extras: Vec<(&'r Col<'a>, &'r Col<'a>)>,
}

impl<'r, 'a> Fields<'r, 'a> {
    fn get(&self, name: &str) -> Option<&'r Col<'a>> {
        let index = DECLARED.iter().position(|known| *known == name)?;
        self.declared[index]
    }
}

fn type_name(value: &Col<'_>) -> &'static str {
    match value {
        Col::Null => "NoneType",
        Col::Bool(_) => "bool",
        Col::UInt(_) | Col::Int(_) => "int",
        Col::Float(..) => "float",
        Col::Str(..) => "str",
        Col::Ids(..) | Col::Probs(..) | Col::Array(_) => "list",
        Col::Object(_) => "dict",
    }
}

fn unrepresentable(name: &str, what: &str) -> String {
    format!("{name} {what} does not fit in an int64 column (freeze() returns it as a Python int)")
}

fn text_field(
    fields: &Fields<'_, '_>,
    name: &str,
    optional: bool,
) -> Result<Option<String>, String> {
    match fields.get(name) {
        None | Some(Col::Null) if optional => Ok(None),
        None => Ok(Some(String::new())),
        Some(Col::Str(raw, escaped)) => Ok(Some(decode_text(raw, *escaped)?.into_owned())),
        Some(other) => Err(format!(
            "{name} must be {}, got {}",
            if optional { "a str or None" } else { "a str" },
            type_name(other)
        )),
    }
}

fn int_field<'r, 'a>(
    fields: &Fields<'r, 'a>,
    name: &str,
    optional: bool,
) -> Result<Option<&'r Col<'a>>, String> {
    match fields.get(name) {
        None => Ok(None),
        Some(Col::Null) if optional => Ok(None),
        Some(value @ (Col::UInt(_) | Col::Int(_))) => Ok(Some(value)),
        Some(other) => Err(format!("{name} must be an int, got {}", type_name(other))),
    }
}

fn bool_field(fields: &Fields<'_, '_>, name: &str) -> Result<bool, String> {
    match fields.get(name) {
        None => Ok(false),
        Some(Col::Bool(value)) => Ok(*value),
        Some(other) => Err(format!("{name} must be a bool, got {}", type_name(other))),
    }
}

impl ColumnBuilder {
    /// An int field that was checked, as an int64.
    fn fits(&self, name: &str, value: Option<&Col<'_>>) -> Result<Option<i64>, String> {
        value
            .map(|value| {
                int_value(value).ok_or_else(|| unrepresentable(name, &render_one(self, value)))
            })
            .transpose()
    }

    /// Check one decoded top-level object as freeze checks a record, and make it a row.
    fn record(&mut self, members: &[(Col<'_>, Col<'_>)]) -> Result<Row, String> {
        let mut fields = Fields {
            declared: [None; DECLARED.len()],
            extras: Vec::new(),
        };
        let mut extra_names: Vec<Cow<'_, str>> = Vec::new();
        for (key, value) in members {
            let Col::Str(raw, escaped) = key else {
                return Err("a key is not a string".to_owned());
            };
            let name = decode_text(raw, *escaped)?;
            self.check_token_field(&name, value)?;
            if let Some(index) = DECLARED.iter().position(|known| *known == name) {
                fields.declared[index] = Some(value);
            } else if let Some(at) = extra_names.iter().position(|known| *known == name) {
                fields.extras[at].1 = value;
            } else {
                extra_names.push(name);
                fields.extras.push((key, value));
            }
        }
        let missing: Vec<&str> = REQUIRED
            .into_iter()
            .filter(|name| fields.get(name).is_none())
            .collect();
        if !missing.is_empty() {
            return Err(format!("missing field(s) {}", missing.join(", ")));
        }
        let rollout_id = text_field(&fields, "rollout_id", false)?.unwrap_or_default();
        let model_call_id = text_field(&fields, "model_call_id", false)?.unwrap_or_default();
        let model = text_field(&fields, "model", false)?.unwrap_or_default();
        let continuation_fingerprint =
            text_field(&fields, "continuation_fingerprint", false)?.unwrap_or_default();
        let continuation_context_digest =
            text_field(&fields, "continuation_context_digest", false)?.unwrap_or_default();
        let parent_resolution_reason =
            text_field(&fields, "parent_resolution_reason", false)?.unwrap_or_default();
        let response_id = text_field(&fields, "response_id", true)?;
        let parent_call_id = text_field(&fields, "parent_call_id", true)?;
        let digest = text_field(&fields, "digest", true)?;
        // Ints: first their types (as freeze checks them), then whether they fit a column.
        let schema_version = int_field(&fields, "schema_version", false)?;
        let context_len = int_field(&fields, "continuation_context_len", false)?;
        let token_item_index = int_field(&fields, "token_item_index", true)?;
        let cum_len = int_field(&fields, "cum_len", true)?;
        let fingerprint_version = int_field(&fields, "fingerprint_version", true)?;
        let prompt_is_delta = bool_field(&fields, "prompt_is_delta")?;
        let prefix_requested = bool_field(&fields, "prefix_requested")?;
        let prefix_supplied = bool_field(&fields, "prefix_supplied")?;
        let created_at = match fields.get("created_at") {
            None => 0.0,
            Some(Col::UInt(value)) => *value as f64,
            Some(Col::Int(text)) => int_as_float(text)?,
            Some(Col::Float(value, _)) => *value,
            Some(other) => {
                return Err(format!(
                    "created_at must be a float, got {}",
                    type_name(other)
                ))
            }
        };
        let parent_resolution = match fields.get("parent_resolution") {
            None | Some(Col::Null) => None,
            Some(Col::Str(raw, escaped)) if STATUSES.contains(&&*decode_text(raw, *escaped)?) => {
                Some(decode_text(raw, *escaped)?.into_owned())
            }
            Some(other) => {
                return Err(format!(
                    "parent_resolution {} is not one of {STATUSES:?}",
                    render_one(self, other)
                ))
            }
        };
        let output_items = match fields.get("output_items") {
            None => 0,
            Some(Col::Array(items)) if items.iter().all(|i| matches!(i, Col::Object(_))) => {
                items.len()
            }
            Some(_) => return Err("output_items must be a list of dicts".to_owned()),
        };
        // The cross-field rules (records.check_entry_invariants).
        let schema_version = match schema_version {
            None => 1,
            Some(value) if int_value(value) == Some(1) => 1,
            Some(value) => {
                return Err(format!(
                    "schema_version {} is not 1, the only one this reader supports",
                    render_one(self, value)
                ))
            }
        };
        let prompt = self.token_range(fields.get("prompt_token_ids"), IdField::Prompt)?;
        let generation =
            self.token_range(fields.get("generation_token_ids"), IdField::Generation)?;
        let log_probs = self.prob_range(fields.get("generation_log_probs"));
        if generation.len() != log_probs.len() {
            return Err(format!(
                "generation_log_probs has {} values for {} generated tokens",
                log_probs.len(),
                generation.len()
            ));
        }
        let token_item_index = match token_item_index {
            None => None,
            Some(value) => match int_value(value) {
                Some(index) if usize::try_from(index).is_ok_and(|i| i < output_items) => {
                    Some(index)
                }
                _ => {
                    return Err(format!(
                        "token_item_index {} does not index output_items (length {output_items})",
                        render_one(self, value)
                    ))
                }
            },
        };
        match parent_resolution.as_deref() {
            Some("resolved") if parent_call_id.as_deref().is_none_or(str::is_empty) => {
                return Err("parent_resolution 'resolved' requires parent_call_id".to_owned())
            }
            Some(status @ ("root" | "unresolved")) if parent_call_id.is_some() => {
                return Err(format!(
                    "parent_resolution '{status}' forbids parent_call_id"
                ))
            }
            status if prompt_is_delta && status != Some("resolved") => {
                return Err("prompt_is_delta requires a resolved parent".to_owned())
            }
            _ => {}
        }
        let continuation_context_len = self
            .fits("continuation_context_len", context_len)?
            .unwrap_or(0);
        let cum_len = self.fits("cum_len", cum_len)?;
        let fingerprint_version = self.fits("fingerprint_version", fingerprint_version)?;
        let routed_experts = match fields.get("routed_experts") {
            None | Some(Col::Null) => None,
            Some(value) => Some(render_one(self, value)),
        };
        let output_items = fields
            .get("output_items")
            .map_or_else(|| "[]".to_owned(), |value| render_one(self, value));
        let extras = (!fields.extras.is_empty()).then(|| {
            let mut out = String::from("{");
            for (index, (key, value)) in fields.extras.iter().enumerate() {
                if index > 0 {
                    out.push(',');
                }
                render(self, key, &mut out);
                out.push(':');
                render(self, value, &mut out);
            }
            out.push('}');
            out
        });
        Ok(Row {
            schema_version,
            rollout_id,
            model_call_id,
            model,
            prompt_token_ids: prompt,
            generation_token_ids: generation,
            generation_log_probs: log_probs,
            routed_experts,
            output_items,
            token_item_index,
            response_id,
            created_at,
            parent_call_id,
            cum_len,
            digest,
            parent_resolution,
            continuation_fingerprint,
            continuation_context_len,
            continuation_context_digest,
            parent_resolution_reason,
            fingerprint_version,
            prompt_is_delta,
            prefix_requested,
            prefix_supplied,
            extras,
        })
    }

    /// Refuse a token field of the wrong shape (freeze checks every occurrence of the key).
    fn check_token_field(&self, name: &str, value: &Col<'_>) -> Result<(), String> {
        let ok = match name {
            "prompt_token_ids" | "generation_token_ids" => match value {
                Col::Ids(..) => true,
                Col::Array(items) => items
                    .iter()
                    .all(|i| matches!(i, Col::UInt(_) | Col::Int(_))),
                _ => false,
            },
            "generation_log_probs" => match value {
                Col::Ids(..) | Col::Probs(..) => true,
                Col::Array(items) => {
                    for item in items.iter() {
                        if let Col::Int(text) = item {
                            int_as_float(text)?;
                        }
                    }
                    items
                        .iter()
                        .all(|i| matches!(i, Col::UInt(_) | Col::Int(_) | Col::Float(..)))
                }
                _ => false,
            },
            _ => true,
        };
        if ok {
            return Ok(());
        }
        let what = if name == "generation_log_probs" {
            "floats"
        } else {
            "ints"
        };
        Err(format!("{name} must be a list of {what}"))
    }

    /// The buffer range of a checked id field, writing it there if it was kept as values.
    fn token_range(
        &mut self,
        value: Option<&Col<'_>>,
        field: IdField,
    ) -> Result<Range<usize>, String> {
        let name = match field {
            IdField::Prompt => "prompt_token_ids",
            IdField::Generation => "generation_token_ids",
        };
        match value {
            Some(&Col::Ids(source, start, len)) if source == field => Ok(start..start + len),
            Some(Col::Ids(..)) => {
                let ids = self.ids_of(value.expect("matched")).unwrap_or(&[]).to_vec();
                let buffer = &mut self.ids[field as usize];
                let start = buffer.len();
                buffer.extend_from_slice(&ids);
                Ok(start..buffer.len())
            }
            Some(Col::Array(items)) => {
                let mut ids = Vec::with_capacity(items.len());
                for item in items.iter() {
                    let id = int_value(item).ok_or_else(|| {
                        unrepresentable(&format!("{name} item"), &render_one(self, item))
                    })?;
                    ids.push(id);
                }
                let buffer = &mut self.ids[field as usize];
                let start = buffer.len();
                buffer.extend_from_slice(&ids);
                Ok(start..buffer.len())
            }
            _ => Ok(0..0), // checked by `check_token_field`
        }
    }

    /// The buffer range of a checked log-prob field, writing it there if it was kept as values.
    fn prob_range(&mut self, value: Option<&Col<'_>>) -> Range<usize> {
        let values: Vec<f64> = match value {
            Some(&Col::Probs(start, len)) => return start..start + len,
            Some(value @ Col::Ids(..)) => self
                .ids_of(value)
                .unwrap_or(&[])
                .iter()
                .map(|&id| id as f64)
                .collect(),
            Some(Col::Array(items)) => items
                .iter()
                .map(|item| match item {
                    Col::UInt(value) => *value as f64,
                    Col::Int(text) => int_as_float(text).unwrap_or(f64::NAN),
                    Col::Float(value, _) => *value,
                    _ => f64::NAN, // checked by `check_token_field`
                })
                .collect(),
            _ => Vec::new(),
        };
        let start = self.probs.len();
        self.probs.extend_from_slice(&values);
        start..self.probs.len()
    }
}

/// An integer's text (one that does not fit a u64: negative or huge) as the float Python makes
/// of that int, as freeze does: `-0` is the int 0, so +0.0, and an int past the largest float
/// is refused with Python's words rather than read as an infinity.
fn int_as_float(text: &[u8]) -> Result<f64, String> {
    let value: f64 = std::str::from_utf8(text)
        .ok()
        .and_then(|text| text.parse().ok())
        .ok_or_else(|| "not an integer".to_string())?;
    if value.is_infinite() {
        return Err("int too large to convert to float".to_string());
    }
    Ok(if value == 0.0 { 0.0 } else { value })
}

/// An integer value that fits an int64.
fn int_value(value: &Col<'_>) -> Option<i64> {
    match value {
        Col::UInt(value) => i64::try_from(*value).ok(),
        Col::Int(text) => std::str::from_utf8(text).ok()?.parse().ok(),
        _ => None,
    }
}

fn render_one(builder: &ColumnBuilder, value: &Col<'_>) -> String {
    let mut out = String::new();
    render(builder, value, &mut out);
    out
}

/// Write `value` as JSON text: strings and numbers as the line spelled them, no whitespace.
fn render(builder: &ColumnBuilder, value: &Col<'_>, out: &mut String) {
    match value {
        Col::Null => out.push_str("null"),
        Col::Bool(value) => out.push_str(if *value { "true" } else { "false" }),
        Col::UInt(value) => {
            let _ = write!(out, "{value}");
        }
        Col::Int(text) | Col::Float(_, Some(text)) | Col::Str(text, _) => {
            // The walk checked that these are UTF-8 (numbers are ASCII).
            out.push_str(std::str::from_utf8(text).unwrap_or("null"));
        }
        Col::Float(value, None) => write_float(*value, out),
        Col::Ids(field, start, len) => {
            out.push('[');
            for (index, id) in builder.ids[*field as usize][*start..*start + *len]
                .iter()
                .enumerate()
            {
                if index > 0 {
                    out.push(',');
                }
                let _ = write!(out, "{id}");
            }
            out.push(']');
        }
        Col::Probs(start, len) => {
            out.push('[');
            for (index, value) in builder.probs[*start..*start + *len].iter().enumerate() {
                if index > 0 {
                    out.push(',');
                }
                write_float(*value, out);
            }
            out.push(']');
        }
        Col::Array(items) => {
            out.push('[');
            for (index, item) in items.iter().enumerate() {
                if index > 0 {
                    out.push(',');
                }
                render(builder, item, out);
            }
            out.push(']');
        }
        Col::Object(members) => {
            out.push('{');
            for (index, (key, value)) in members.iter().enumerate() {
                if index > 0 {
                    out.push(',');
                }
                render(builder, key, out);
                out.push(':');
                render(builder, value, out);
            }
            out.push('}');
        }
    }
}

/// A float as JSON: the shortest text that reads back as the same value (an overflowing
/// literal for the infinities a JSON literal like `1e999` parses to).
fn write_float(value: f64, out: &mut String) {
    if value.is_finite() {
        let _ = write!(out, "{value:?}");
    } else if value > 0.0 {
        out.push_str("1e999");
    } else if value < 0.0 {
        out.push_str("-1e999");
    } else {
        out.push_str("null");
    }
}

// ---- decoding a store's lines --------------------------------------------------------------

/// What the decoder made of every complete line it was handed.
pub struct Decoded {
    builder: ColumnBuilder,
    rows: Vec<Result<Row, String>>,
}

/// Decode the lines a store hands over into rows: a small log's in one walk, a large log's by
/// replaying the tapes another thread makes while it reads.
pub fn decode_columns(lines: LinesToDecode<'_>) -> Decoded {
    decode_with(lines, false)
}

/// [`decode_columns`], with `shared_prefixes`: a prompt that begins with the whole previous
/// prompt, when that one ends the prompt buffer, starts where it does and only its new suffix
/// is written (the rows' prompt ranges then overlap; [`assemble`] makes a list view of them).
fn decode_with(lines: LinesToDecode<'_>, shared_prefixes: bool) -> Decoded {
    let mut builder = ColumnBuilder {
        shared_prefixes,
        ..ColumnBuilder::default()
    };
    let mut rows = Vec::new();
    match lines {
        LinesToDecode::Whole { buf, lines } => {
            decode_walked(
                &mut builder,
                &mut rows,
                lines.iter().map(|range| &buf[range.clone()]),
            );
        }
        LinesToDecode::Taped(feed) => {
            // This thread keeps up with the walk: parse the log-probs here, off its thread.
            feed.parse_floats_here();
            replay(&mut builder, &mut rows, feed);
        }
    }
    Decoded { builder, rows }
}

fn decode_walked<'b>(
    builder: &mut ColumnBuilder,
    rows: &mut Vec<Result<Row, String>>,
    lines: impl IntoIterator<Item = &'b [u8]>,
) {
    let mut repeats = Repeats::new();
    for line in lines {
        builder.start_line();
        let walked = json::build(line, builder, Some(&mut repeats)).map(drop);
        rows.push(builder.finish_line(walked.map_err(|err| err.0)));
    }
}

fn replay(builder: &mut ColumnBuilder, rows: &mut Vec<Result<Row, String>>, feed: TapeFeed<'_>) {
    // The values kept for later lines outlive the line they were built from (whose chunk may
    // then be reused): they are arrays of plain integers, which borrow nothing (`kept`).
    let mut replay: Replay<Col<'static>> = Replay::new();
    let mut lines = feed.iter();
    loop {
        if let Some(side) = feed.urgent_side_work() {
            while side.step() {}
        }
        let Some(taped) = lines.next() else { break };
        builder.start_line();
        let mut this_line: Replay<Col<'_>> = replay;
        let walked = match &taped.tape {
            Ok(tape) => this_line.value(tape, taped.line(), builder).map(drop),
            Err(err) => Err(err.clone()),
        };
        replay = this_line.filter_map(kept);
        let failed_in_replay = taped.tape.is_ok() && walked.is_err();
        feed.give_back(taped);
        rows.push(builder.finish_line(walked.map_err(|err| err.0)));
        if failed_in_replay {
            // Later tapes may repeat an array of this line that was never built: walk the
            // rest directly.
            let rest: Vec<_> = lines.collect();
            decode_walked(builder, rows, rest.iter().map(|taped| taped.line()));
            return;
        }
    }
}

/// A value a replay keeps for later lines, free of its line: an array of plain integers
/// borrows nothing. A value holding text (never kept: `Replay` keeps arrays of plain
/// integers only) is dropped; a later line repeating it would then fail as a broken replay.
fn kept(value: Col<'_>) -> Option<Col<'static>> {
    Some(match value {
        Col::Null => Col::Null,
        Col::Bool(value) => Col::Bool(value),
        Col::UInt(value) => Col::UInt(value),
        Col::Ids(field, start, len) => Col::Ids(field, start, len),
        Col::Probs(start, len) => Col::Probs(start, len),
        Col::Float(value, None) => Col::Float(value, None),
        Col::Array(items) => {
            let items: Option<Vec<Col<'static>>> = items.iter().cloned().map(kept).collect();
            Col::Array(Rc::new(items?))
        }
        Col::Int(_) | Col::Float(_, Some(_)) | Col::Str(..) | Col::Object(_) => return None,
    })
}

// ---- assembling a snapshot -----------------------------------------------------------------

/// One list column: `values`, and `offsets` (one more than the rows) into them; or, when
/// `sizes` is set, a list view: row i is `values[offsets[i]..offsets[i] + sizes[i]]` (one
/// offset per row), rows may overlap.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ListColumn<T> {
    pub values: Vec<T>,
    pub offsets: Vec<i32>,
    pub sizes: Option<Vec<i32>>,
}

impl<T> ListColumn<T> {
    /// Row `at`'s values.
    pub fn part(&self, at: usize) -> &[T] {
        part_of(self.parts(), at)
    }

    pub fn parts(&self) -> ListParts<'_, T> {
        (&self.values, &self.offsets, self.sizes.as_deref())
    }
}

/// Row `at` of a list column's parts.
pub fn part_of<T>((values, offsets, sizes): ListParts<'_, T>, at: usize) -> &[T] {
    let start = offsets[at] as usize;
    let end = match sizes {
        Some(sizes) => start + sizes[at] as usize,
        None => offsets[at + 1] as usize,
    };
    &values[start..end]
}

/// A snapshot's entries as columns, in commit order.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Entries {
    /// Every field but the token arrays, one per entry; their ranges index the columns'
    /// values as they were decoded, not `prompt` etc.
    pub rows: Vec<Row>,
    pub prompt_token_ids: ListColumn<i64>,
    pub generation_token_ids: ListColumn<i64>,
    pub generation_log_probs: ListColumn<f64>,
}

/// Why a columnar read failed.
#[derive(Debug)]
pub enum ColumnsError {
    /// What freeze or read_entries would fail with, too.
    Store(Error),
    /// A record is not a valid entry, or holds a value the columns cannot.
    Record(RecordError),
}

impl From<Error> for ColumnsError {
    fn from(err: Error) -> Self {
        ColumnsError::Store(err)
    }
}

/// The parts of `buffer` at `ranges`, in order, as one list column; when they are the whole
/// buffer in order (the usual case) the buffer is taken as it is.
fn list_column<T: Copy>(
    mut buffer: Vec<T>,
    ranges: impl ExactSizeIterator<Item = Range<usize>> + Clone,
    name: &str,
) -> Result<ListColumn<T>, String> {
    let total: usize = ranges.clone().map(|range| range.len()).sum();
    if i32::try_from(total).is_err() {
        return Err(format!(
            "{name} holds {total} values in all, more than an Arrow list column's 2**31-1"
        ));
    }
    let mut offsets = Vec::with_capacity(ranges.len() + 1);
    offsets.push(0i32);
    let mut end = 0;
    let mut in_place = true;
    for range in ranges.clone() {
        in_place &= range.start == end;
        end = range.end;
    }
    in_place &= end == buffer.len();
    let values = if in_place {
        buffer.shrink_to_fit();
        buffer
    } else {
        let mut values = Vec::with_capacity(total);
        for range in ranges.clone() {
            values.extend_from_slice(&buffer[range]);
        }
        values
    };
    let mut at = 0i32;
    for range in ranges {
        at += range.len() as i32; // the total fits, so every partial sum does
        offsets.push(at);
    }
    Ok(ListColumn {
        values,
        offsets,
        sizes: None,
    })
}

/// The whole of `buffer` as a list view with a row at each of `ranges` (which may overlap or
/// leave parts unused): nothing is copied.
fn list_view_column<T>(
    mut buffer: Vec<T>,
    ranges: impl ExactSizeIterator<Item = Range<usize>>,
    name: &str,
) -> Result<ListColumn<T>, String> {
    if i32::try_from(buffer.len()).is_err() {
        return Err(format!(
            "{name} holds {} values in all, more than an Arrow list view's 2**31-1",
            buffer.len()
        ));
    }
    buffer.shrink_to_fit();
    let mut offsets = Vec::with_capacity(ranges.len());
    let mut sizes = Vec::with_capacity(ranges.len());
    for range in ranges {
        // Every range lies within the buffer, whose length fits.
        offsets.push(range.start as i32);
        sizes.push(range.len() as i32);
    }
    Ok(ListColumn {
        values: buffer,
        offsets,
        sizes: Some(sizes),
    })
}

/// The rows of `records` (whose lines are a subsequence of `ranges`, which `decoded` follows).
fn assemble(
    log: &std::path::Path,
    ranges: &[Range<usize>],
    decoded: Decoded,
    records: &Records,
) -> Result<Entries, ColumnsError> {
    let Decoded { builder, rows } = decoded;
    let shared_prefixes = builder.shared_prefixes;
    let mut decoded = ranges.iter().zip(rows);
    let mut selected = Vec::with_capacity(records.lines.len());
    for wanted in &records.lines {
        let offset = wanted.start as u64;
        let Some((_, row)) = decoded.find(|(range, _)| range.start == wanted.start) else {
            let detail = "the record's line was not decoded";
            return Err(Error::corrupt(log, offset, detail).into());
        };
        selected
            .push(row.map_err(|message| ColumnsError::Record(RecordError { offset, message }))?);
    }
    let record_error = |message: String| {
        ColumnsError::Record(RecordError {
            offset: records.lines.first().map_or(0, |line| line.start as u64),
            message,
        })
    };
    let ColumnBuilder {
        ids: [prompt, generation],
        probs,
        ..
    } = builder;
    let prompt_ranges = selected.iter().map(|row| row.prompt_token_ids.clone());
    let prompt = if shared_prefixes {
        list_view_column(prompt, prompt_ranges, "prompt_token_ids")
    } else {
        list_column(prompt, prompt_ranges, "prompt_token_ids")
    }
    .map_err(record_error)?;
    let generation = list_column(
        generation,
        selected.iter().map(|row| row.generation_token_ids.clone()),
        "generation_token_ids",
    )
    .map_err(record_error)?;
    let probs = list_column(
        probs,
        selected.iter().map(|row| row.generation_log_probs.clone()),
        "generation_log_probs",
    )
    .map_err(record_error)?;
    Ok(Entries {
        rows: selected,
        prompt_token_ids: prompt,
        generation_token_ids: generation,
        generation_log_probs: probs,
    })
}

/// What [`freeze_columns`] returns: freeze's snapshot, with the entries as columns.
#[derive(Debug)]
pub struct ColumnarSnapshot {
    pub entries: Entries,
    pub incomplete: bool,
    pub snapshot_id: String,
    pub version: u64,
}

/// [`Store::freeze`] with the entries decoded into columns (see the module documentation);
/// with `shared_prefixes`, the prompt column is a list view sharing repeated prompt prefixes.
pub fn freeze_columns(
    store: &Store,
    rollout_id: &str,
    shared_prefixes: bool,
) -> Result<ColumnarSnapshot, ColumnsError> {
    let decode = |lines: LinesToDecode<'_>| decode_with(lines, shared_prefixes);
    let (snapshot, ranges, decoded) = store.freeze_decoding(rollout_id, decode)?;
    let log = store.paths(rollout_id).log;
    let entries = assemble(&log, &ranges, decoded, &snapshot.records);
    store.recycle_buffer(snapshot.records.buf);
    Ok(ColumnarSnapshot {
        entries: entries?,
        incomplete: snapshot.incomplete,
        snapshot_id: snapshot.snapshot_id,
        version: snapshot.version,
    })
}

/// [`Store::read_records`] with the entries decoded into columns (`shared_prefixes` as for
/// [`freeze_columns`]).
pub fn read_columns(
    store: &Store,
    rollout_id: &str,
    shared_prefixes: bool,
) -> Result<Entries, ColumnsError> {
    let decode = |lines: LinesToDecode<'_>| decode_with(lines, shared_prefixes);
    let (records, ranges, decoded) = store.read_decoding(rollout_id, decode)?;
    let log = store.paths(rollout_id).log;
    let entries = assemble(&log, &ranges, decoded, &records);
    store.recycle_buffer(records.buf);
    entries
}

/// A log fetched whole from another backend (see [`crate::fetched`]: its lines checked against
/// their stored digests, the first line of each call id a record) as columns; refusals name
/// `source` and byte offsets in the joined log. `shared_prefixes` as for [`freeze_columns`].
pub fn columns_of_log(
    log: crate::fetched::FetchedLog<'_>,
    digests: Option<&[String]>,
    source: &std::path::Path,
    shared_prefixes: bool,
) -> Result<Entries, ColumnsError> {
    let decode = |lines: LinesToDecode<'_>| decode_with(lines, shared_prefixes);
    let (records, ranges, decoded) = log.decode(digests, source, decode)?;
    assemble(source, &ranges, decoded, &records)
}

/// Lines that are all records (canonical lines stored apart, their digests checked by the
/// caller) as columns. A refused line's error carries its index among `lines` as the offset.
/// The PostgreSQL store decodes its fetched lines with [`columns_of_log`] instead.
pub fn columns_of_lines(lines: &[&[u8]]) -> Result<Entries, RecordError> {
    let mut buf = Vec::with_capacity(lines.iter().map(|line| line.len() + 1).sum());
    let mut ranges = Vec::with_capacity(lines.len());
    for line in lines {
        let start = buf.len();
        buf.extend_from_slice(line);
        ranges.push(start..buf.len());
        buf.push(b'\n');
    }
    let decoded = decode_columns(LinesToDecode::Whole {
        buf: &buf,
        lines: &ranges,
    });
    let records = Records {
        buf: Vec::new(),
        lines: ranges.clone(),
    };
    let index_of = |offset: u64| ranges.iter().position(|r| r.start as u64 == offset);
    match assemble(std::path::Path::new(""), &ranges, decoded, &records) {
        Ok(entries) => Ok(entries),
        Err(ColumnsError::Record(err)) => Err(RecordError {
            offset: index_of(err.offset).unwrap_or(0) as u64,
            message: err.message,
        }),
        Err(ColumnsError::Store(err)) => Err(RecordError {
            offset: 0,
            message: err.to_string(),
        }),
    }
}

// ---- cumulative tokens ---------------------------------------------------------------------

/// What the delta chain of an entry needs to know of it.
#[derive(Debug, Clone, Copy)]
pub struct Link<'r> {
    pub call_id: &'r str,
    pub parent_call_id: Option<&'r str>,
    pub prompt_is_delta: bool,
}

/// A list column's `(values, offsets, sizes)` (sizes for a list view; see [`ListColumn`]).
pub type ListParts<'r, T> = (&'r [T], &'r [i32], Option<&'r [i32]>);

/// Per entry, the token sequence after its call: prompt then generation, an entry whose prompt
/// is a delta preceded by its parent's sequence (through the parent chain, within the same
/// entries; a missing parent or a cycle is an error). One flat buffer with offsets, in the
/// entries' order.
pub fn cumulative_tokens(
    links: &[Link<'_>],
    prompt: ListParts<'_, i64>,
    generation: ListParts<'_, i64>,
) -> Result<ListColumn<i64>, String> {
    let mut index = std::collections::HashMap::with_capacity(links.len());
    for (at, link) in links.iter().enumerate() {
        index.entry(link.call_id).or_insert(at);
    }
    let mut values = Vec::new();
    let mut offsets = Vec::with_capacity(links.len() + 1);
    offsets.push(0i32);
    let mut chain = Vec::new();
    for (at, link) in links.iter().enumerate() {
        chain.clear();
        chain.push(at);
        let mut current = *link;
        while current.prompt_is_delta {
            let parent = current.parent_call_id;
            let named = || parent.map_or_else(|| "None".to_owned(), |p| format!("{p:?}"));
            let Some(&parent_at) = parent.and_then(|parent| index.get(parent)) else {
                return Err(format!(
                    "entry {:?}: its delta chain breaks at missing parent {}",
                    link.call_id,
                    named()
                ));
            };
            if chain.contains(&parent_at) {
                return Err(format!(
                    "entry {:?}: its delta chain has a cycle at {}",
                    link.call_id,
                    named()
                ));
            }
            chain.push(parent_at);
            current = links[parent_at];
        }
        for &step in chain.iter().rev() {
            values.extend_from_slice(part_of(prompt, step));
            values.extend_from_slice(part_of(generation, step));
        }
        let end = i32::try_from(values.len()).map_err(|_| {
            "the cumulative sequences hold more than an Arrow list column's 2**31-1 ids".to_owned()
        })?;
        offsets.push(end);
    }
    Ok(ListColumn {
        values,
        offsets,
        sizes: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::json::tape::{tape_channel, tape_lines, LineTaper};
    use serde_json::{json, Value};

    fn ranges_of(buf: &[u8]) -> Vec<Range<usize>> {
        let mut ranges = Vec::new();
        let mut start = 0;
        for (at, &byte) in buf.iter().enumerate() {
            if byte == b'\n' {
                ranges.push(start..at);
                start = at + 1;
            }
        }
        ranges
    }

    /// The tapes of the lines, in a channel, their floats parsed by the walk or left as text
    /// (as a streamed read tapes them once the builder asks to parse them itself).
    fn taped_feed<'b>(buf: &'b [u8], ranges: &[Range<usize>], as_text: bool) -> TapeFeed<'b> {
        let (sink, feed) = tape_channel(ranges.len() + 1);
        let mut taper = LineTaper::new();
        taper.floats_as_text(as_text);
        for range in ranges {
            let line = &buf[range.clone()];
            let tape = taper.tape(line);
            let line = crate::ring::LineBytes::Borrowed(line);
            sink.send(crate::json::tape::LineTape { line, tape });
        }
        feed
    }

    /// The lines decoded in one walk and by replaying tapes (as a large log is).
    fn decode_both(buf: &[u8], ranges: &[Range<usize>]) -> (Decoded, Decoded) {
        let whole = decode_columns(LinesToDecode::Whole { buf, lines: ranges });
        let (sink, feed) = tape_channel(ranges.len() + 1);
        tape_lines(buf, ranges, |line| sink.send(line));
        drop(sink);
        (whole, decode_columns(LinesToDecode::Taped(feed)))
    }

    fn entry(call: usize, prompt: &[u64], generation: &[u64], extra: Value) -> Value {
        let mut value = json!({
            "rollout_id": "r",
            "model_call_id": format!("c{call}"),
            "prompt_token_ids": prompt,
            "generation_token_ids": generation,
            "generation_log_probs": generation.iter().map(|&id| -(id as f64) / 7.0).collect::<Vec<_>>(),
            "created_at": 1.5,
        });
        if let (Value::Object(fields), Value::Object(more)) = (&mut value, extra) {
            fields.extend(more);
        }
        value
    }

    /// Lines like an agentic rollout's (each prompt repeats the last prompt and answer), with
    /// arrays under token keys in nested objects, a duplicate and a refused line among them.
    fn rollout_lines() -> (Vec<u8>, Vec<Value>) {
        let mut values = Vec::new();
        let mut prompt: Vec<u64> = (0..300).map(|i| i * 7 % 1000).collect();
        for call in 0..6 {
            let generation: Vec<u64> = (0..80).map(|i| (i + call as u64) * 13 % 997).collect();
            let extra = match call {
                2 => json!({"a_note": {"prompt_token_ids": (0..90).collect::<Vec<u64>>()},
                            "routed_experts": {"generation_token_ids": [1, "x"]}}),
                3 => json!({"output_items": [{"generation_log_probs": [0.5, 1]}],
                            "token_item_index": 0}),
                _ => json!({}),
            };
            values.push(entry(call, &prompt, &generation, extra));
            prompt.extend(&generation);
            prompt.extend((0..40).map(|i| i + 5000 + call as u64));
        }
        let mut buf = Vec::new();
        for value in &values {
            buf.extend(serde_json::to_vec(value).unwrap());
            buf.push(b'\n');
        }
        let duplicate = serde_json::to_vec(&values[1]).unwrap();
        buf.extend(&duplicate);
        buf.push(b'\n');
        (buf, values)
    }

    fn ids(value: &Value) -> Vec<i64> {
        value
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_i64().unwrap())
            .collect()
    }

    fn floats(value: &Value) -> Vec<f64> {
        value
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap())
            .collect()
    }

    fn part<T: Copy>(column: &ListColumn<T>, at: usize) -> Vec<T> {
        column.part(at).to_vec()
    }

    #[test]
    fn a_replayed_decode_builds_what_a_walk_builds() {
        let (buf, _) = rollout_lines();
        let ranges = ranges_of(&buf);
        let (whole, taped) = decode_both(&buf, &ranges);
        assert_eq!(whole.rows, taped.rows);
        assert_eq!(whole.builder.ids, taped.builder.ids);
        assert_eq!(whole.builder.probs, taped.builder.probs);
        assert!(whole.rows.iter().all(Result::is_ok));
    }

    /// Token arrays whose packed runs (a replay hands ids and floats over a run at a time)
    /// break anywhere: an id beyond int64, a float among ids, an int or a string among
    /// log-probs, a nested array, each after a prefix that repeats an earlier array.
    fn mixed_token_lines(rng: &mut crate::json::tests::Lcg) -> Vec<u8> {
        let odd = [
            "18446744073709551615",
            "9223372036854775808",
            "1.5",
            "-3",
            "\"x\"",
            "[1]",
        ];
        let mut earlier: Vec<String> = (0..100).map(|i| (i * 31 % 5000).to_string()).collect();
        let mut buf = Vec::new();
        for call in 0..4 {
            let mut prompt = earlier.clone();
            let mut generation: Vec<String> = Vec::new();
            let mut probs: Vec<String> = Vec::new();
            for _ in 0..1 + rng.next(70) {
                let at = rng.next(24);
                let pick = odd[rng.next(odd.len() as u64) as usize].to_owned();
                let id = rng.next(50_000).to_string();
                match at {
                    0 => prompt.push(pick),
                    1 => generation.push(pick),
                    2 => probs.push(if rng.next(2) == 0 { "0".into() } else { pick }),
                    _ => {
                        generation.push(id.clone());
                        probs.push(format!("-{}.{}", rng.next(9), rng.next(1000)));
                        prompt.push(id);
                    }
                }
            }
            let line = format!(
                r#"{{"rollout_id":"r","model_call_id":"c{call}","prompt_token_ids":[{}],"generation_token_ids":[{}],"generation_log_probs":[{}]}}"#,
                prompt.join(","),
                generation.join(","),
                probs.join(",")
            );
            buf.extend(line.as_bytes());
            buf.push(b'\n');
            if rng.next(2) == 0 {
                earlier = prompt;
            }
        }
        buf
    }

    #[test]
    fn replayed_runs_build_what_a_walk_builds_wherever_a_run_breaks() {
        let mut rng = crate::json::tests::Lcg(24);
        let (mut refused, mut kept) = (0, 0);
        for _ in 0..300 {
            let buf = mixed_token_lines(&mut rng);
            let ranges = ranges_of(&buf);
            for (shared, floats_as_text) in [(false, false), (true, false), (false, true)] {
                let whole = decode_with(
                    LinesToDecode::Whole {
                        buf: &buf,
                        lines: &ranges,
                    },
                    shared,
                );
                let feed = taped_feed(&buf, &ranges, floats_as_text);
                let taped = decode_with(LinesToDecode::Taped(feed), shared);
                assert_eq!(whole.rows, taped.rows, "{}", String::from_utf8_lossy(&buf));
                assert_eq!(whole.builder.ids, taped.builder.ids);
                assert_eq!(whole.builder.probs, taped.builder.probs);
                refused += whole.rows.iter().filter(|row| row.is_err()).count();
                kept += whole.rows.iter().filter(|row| row.is_ok()).count();
            }
        }
        assert!(
            refused > 100 && kept > 100,
            "{refused} refused, {kept} kept"
        );
    }

    #[test]
    fn records_become_columns_equal_to_their_json() {
        let (buf, values) = rollout_lines();
        let ranges = ranges_of(&buf);
        // The records: every line but the duplicate (the last line), as a store selects them.
        let records = Records {
            buf: Vec::new(),
            lines: ranges[..values.len()].to_vec(),
        };
        for decoded in [decode_both(&buf, &ranges).0, decode_both(&buf, &ranges).1] {
            let log = std::path::Path::new("r.tokens.jsonl");
            let entries = assemble(log, &ranges, decoded, &records).unwrap();
            assert_eq!(entries.rows.len(), values.len());
            for (at, value) in values.iter().enumerate() {
                assert_eq!(
                    part(&entries.prompt_token_ids, at),
                    ids(&value["prompt_token_ids"])
                );
                assert_eq!(
                    part(&entries.generation_token_ids, at),
                    ids(&value["generation_token_ids"])
                );
                assert_eq!(
                    part(&entries.generation_log_probs, at),
                    floats(&value["generation_log_probs"])
                );
                let row = &entries.rows[at];
                assert_eq!(row.model_call_id, format!("c{at}"));
                let output_items: Value = serde_json::from_str(&row.output_items).unwrap();
                assert_eq!(
                    output_items,
                    *value.get("output_items").unwrap_or(&json!([]))
                );
                let routed: Value = row
                    .routed_experts
                    .as_deref()
                    .map_or(Value::Null, |t| serde_json::from_str(t).unwrap());
                assert_eq!(routed, *value.get("routed_experts").unwrap_or(&Value::Null));
                let extras: Value = row
                    .extras
                    .as_deref()
                    .map_or(json!({}), |t| serde_json::from_str(t).unwrap());
                let expected = value
                    .get("a_note")
                    .map_or(json!({}), |n| json!({"a_note": n}));
                assert_eq!(extras, expected);
            }
        }
    }

    #[test]
    fn shared_prefixes_point_at_the_ids_a_default_decode_copies() {
        let (buf, values) = rollout_lines();
        let ranges = ranges_of(&buf);
        let records = Records {
            buf: Vec::new(),
            lines: ranges[..values.len()].to_vec(),
        };
        let log = std::path::Path::new("r.tokens.jsonl");
        let (default, _) = decode_both(&buf, &ranges);
        let default = assemble(log, &ranges, default, &records).unwrap();
        let (sink, feed) = tape_channel(ranges.len() + 1);
        tape_lines(&buf, &ranges, |line| sink.send(line));
        drop(sink);
        let whole = decode_with(
            LinesToDecode::Whole {
                buf: &buf,
                lines: &ranges,
            },
            true,
        );
        for decoded in [whole, decode_with(LinesToDecode::Taped(feed), true)] {
            let shared = assemble(log, &ranges, decoded, &records).unwrap();
            let (prompt, copied) = (&shared.prompt_token_ids, &default.prompt_token_ids);
            let sizes = prompt.sizes.as_deref().expect("a list view");
            assert_eq!(sizes.len(), values.len());
            for (at, value) in values.iter().enumerate() {
                assert_eq!(prompt.part(at), copied.part(at));
                assert_eq!(prompt.part(at), ids(&value["prompt_token_ids"]));
            }
            // Calls 0 and 1 share their ids; call 2 follows a nested prompt array, so it
            // starts a region of its own, which call 3 then extends.
            assert_eq!(prompt.offsets[1], prompt.offsets[0]);
            assert_ne!(prompt.offsets[2], prompt.offsets[1]);
            assert_eq!(prompt.offsets[3], prompt.offsets[2]);
            // Stored once: call 0, call 1's suffix, the nested array, call 2 whole, the
            // suffixes of calls 3-5, and the duplicate line's prompt (a copy: it does not
            // extend the prompt that ends the buffer); the copying decode holds 3,600.
            assert_eq!(prompt.values.len(), 300 + 120 + 90 + 540 + 3 * 120 + 420);
            assert_eq!(copied.values.len(), 3600);
            assert_eq!(shared.generation_token_ids, default.generation_token_ids);
            assert_eq!(shared.generation_log_probs, default.generation_log_probs);
        }
    }

    #[test]
    fn lines_that_are_not_entries_are_refused_with_their_reason() {
        let good = entry(0, &[1, 2], &[3], json!({}));
        let cases: [(Value, &str); 8] = [
            (json!([1, 2]), "expected a JSON object"),
            (
                json!({"model_call_id": "x"}),
                "missing field(s) rollout_id, prompt_token_ids",
            ),
            (
                entry(1, &[1], &[2], json!({"prompt_token_ids": [1, "a"]})),
                "must be a list of ints",
            ),
            (
                entry(1, &[1], &[2], json!({"generation_log_probs": []})),
                "has 0 values for 1",
            ),
            (
                entry(1, &[1], &[], json!({"schema_version": 2})),
                "schema_version 2",
            ),
            (
                entry(1, &[1], &[], json!({"parent_resolution": "maybe"})),
                "not one of",
            ),
            (
                entry(1, &[1], &[], json!({"prompt_is_delta": true})),
                "requires a resolved parent",
            ),
            (
                entry(1, &[1], &[], json!({"prompt_token_ids": [u64::MAX]})),
                "does not fit in an int64",
            ),
        ];
        for (value, reason) in cases {
            let mut buf = serde_json::to_vec(&good).unwrap();
            buf.push(b'\n');
            buf.extend(serde_json::to_vec(&value).unwrap());
            buf.push(b'\n');
            let ranges = ranges_of(&buf);
            let (whole, taped) = decode_both(&buf, &ranges);
            assert_eq!(whole.rows, taped.rows);
            assert!(whole.rows[0].is_ok());
            let refused = whole.rows[1].as_ref().unwrap_err();
            assert!(refused.contains(reason), "{refused:?} lacks {reason:?}");
        }
    }

    #[test]
    fn cumulative_tokens_follow_delta_chains() {
        let link = |call_id, parent_call_id, prompt_is_delta| Link {
            call_id,
            parent_call_id,
            prompt_is_delta,
        };
        let links = [
            link("a", None, false),
            link("b", Some("a"), true),
            link("c", Some("b"), true),
            link("d", Some("a"), false),
        ];
        let prompt = ([1, 2, 4, 7, 9].as_slice(), [0, 2, 3, 4, 5].as_slice(), None);
        let generation = ([3, 5, 6, 8].as_slice(), [0, 1, 3, 3, 4].as_slice(), None);
        let cumulative = cumulative_tokens(&links, prompt, generation).unwrap();
        assert_eq!(
            cumulative.values,
            [1, 2, 3, 1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 6, 7, 9, 8]
        );
        assert_eq!(cumulative.offsets, [0, 3, 9, 16, 18]);
        let cycle = [link("a", Some("b"), true), link("b", Some("a"), true)];
        let two = ([1, 2].as_slice(), [0, 1, 2].as_slice(), None);
        let none = ([].as_slice(), [0, 0, 0].as_slice(), None);
        assert!(cumulative_tokens(&cycle, two, none)
            .unwrap_err()
            .contains("cycle"));
        let orphan = [link("a", Some("gone"), true)];
        let one = ([1].as_slice(), [0, 1].as_slice(), None);
        let err = cumulative_tokens(&orphan, one, ([].as_slice(), [0, 0].as_slice(), None));
        assert!(err.unwrap_err().contains("missing parent \"gone\""));
    }
}
