//! The validating JSON walk over one stored line.
//!
//! Every reader of a log walks its lines with `Scanner`: it checks the grammar byte by byte
//! (strings, escapes and UTF-8, numbers, literals, separators, nesting) and hands each value to
//! a [`Builder`], which decides what it becomes: nothing ([`Validate`]), or Python objects built
//! straight from the bytes (the binding). There is no intermediate tree, except in a two-stage
//! read ([`tape`]): one thread walks lines into compact [`tape::Tape`]s, and another replays
//! them into its builder with exactly the calls a direct walk would have made.
//!
//! **Repeated token arrays.** In an agentic rollout every full prompt contains the previous
//! prompt and its answer, so most of a log's bytes repeat arrays that an earlier line already
//! held. A walk over several lines can carry a [`Repeats`]: it remembers the last few long
//! arrays of plain non-negative integers, and when a new array starts with the same bytes as
//! whole items of one of them (or of several in a row) those items are taken as they are,
//! compared with `memcmp` instead of parsed. Equal bytes are equally valid and decode to equal
//! values, so this changes nothing but the cost.

use std::collections::VecDeque;

pub mod tape;

/// Why a line is not a record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LineError(pub String);

/// Receives the values of a JSON document as the validating walk meets them.
///
/// The walk owns the grammar; a builder decides what a value becomes. [`Validate`] builds
/// nothing (its values are `()`, so arrays of them never allocate).
pub trait Builder<'a> {
    type Value: Clone;
    /// An array while its items are being walked.
    type Items;
    type Error: From<LineError>;

    fn null(&mut self) -> Result<Self::Value, Self::Error>;
    fn boolean(&mut self, value: bool) -> Result<Self::Value, Self::Error>;
    /// `text` is a valid JSON number; `integer` when it has no fraction or exponent.
    fn number(&mut self, text: &'a [u8], integer: bool) -> Result<Self::Value, Self::Error>;
    /// A non-negative integer that fits in a u64 (`text` is its digits): the common case of
    /// token ids, handed over already parsed.
    fn unsigned(&mut self, value: u64, text: &'a [u8]) -> Result<Self::Value, Self::Error> {
        let _ = value;
        self.number(text, true)
    }
    /// A number with a fraction or an exponent, already parsed (a replayed [`tape::Tape`]);
    /// `text` is its JSON text.
    fn float(&mut self, value: f64, text: &'a [u8]) -> Result<Self::Value, Self::Error> {
        let _ = value;
        self.number(text, false)
    }
    /// `raw` is a valid JSON string with its quotes; `escaped` when it contains a backslash.
    fn string(&mut self, raw: &'a [u8], escaped: bool) -> Result<Self::Value, Self::Error>;
    /// A new, empty array.
    fn items(&mut self) -> Result<Self::Items, Self::Error>;
    fn push(&mut self, items: &mut Self::Items, item: Self::Value) -> Result<(), Self::Error>;
    /// Push plain non-negative integers in a row, `text(i)` the digits of `values[i]`: a
    /// replayed [`tape::Tape`] keeps runs of them packed, so a builder that stores them in bulk
    /// (the columns) can take a run in one call. By default each goes to
    /// [`Builder::unsigned`] and [`Builder::push`], as a direct walk hands them over.
    fn push_unsigned_run(
        &mut self,
        items: &mut Self::Items,
        values: &[u64],
        text: impl Fn(usize) -> &'a [u8],
    ) -> Result<(), Self::Error> {
        push_each(self, items, values.len(), |b, i| {
            b.unsigned(values[i], text(i))
        })
    }
    /// [`Builder::push_unsigned_run`] for floats ([`Builder::float`] each by default).
    fn push_float_run(
        &mut self,
        items: &mut Self::Items,
        values: &[f64],
        text: impl Fn(usize) -> &'a [u8],
    ) -> Result<(), Self::Error> {
        push_each(self, items, values.len(), |b, i| {
            b.float(values[i], text(i))
        })
    }
    /// [`Builder::push_unsigned_run`] for floats left as text: `text(i)` for each `i` below
    /// `count` ([`Builder::number`] each by default).
    fn push_float_text_run(
        &mut self,
        items: &mut Self::Items,
        count: usize,
        text: impl Fn(usize) -> &'a [u8],
    ) -> Result<(), Self::Error> {
        push_each(self, items, count, |b, i| b.number(text(i), false))
    }
    /// Append the first `count` items of `earlier`, an array of unsigned integers this builder
    /// returned before: the walk met the same bytes again (see [`Repeats`]).
    fn reuse(
        &mut self,
        items: &mut Self::Items,
        earlier: &Self::Value,
        count: usize,
    ) -> Result<(), Self::Error>;
    /// The finished array; `all_unsigned` when every item was a non-negative integer (handed
    /// to `unsigned`, or reused).
    fn array(&mut self, items: Self::Items, all_unsigned: bool)
        -> Result<Self::Value, Self::Error>;
    /// `depth` is 1 for the top-level object of a line.
    fn object(
        &mut self,
        members: Vec<(Self::Value, Self::Value)>,
        depth: usize,
    ) -> Result<Self::Value, Self::Error>;
}

/// Push `count` items one at a time, item `i` built by `make(builder, i)`, as a direct walk
/// hands them over: what the `push_*_run` methods of [`Builder`] do by default.
pub fn push_each<'a, B: Builder<'a> + ?Sized>(
    builder: &mut B,
    items: &mut B::Items,
    count: usize,
    mut make: impl FnMut(&mut B, usize) -> Result<B::Value, B::Error>,
) -> Result<(), B::Error> {
    for i in 0..count {
        let item = make(builder, i)?;
        builder.push(items, item)?;
    }
    Ok(())
}

/// The builder that only validates.
pub struct Validate;

impl Builder<'_> for Validate {
    type Value = ();
    type Items = ();
    type Error = LineError;

    fn null(&mut self) -> Result<(), LineError> {
        Ok(())
    }
    fn boolean(&mut self, _: bool) -> Result<(), LineError> {
        Ok(())
    }
    fn number(&mut self, _: &[u8], _: bool) -> Result<(), LineError> {
        Ok(())
    }
    fn string(&mut self, _: &[u8], _: bool) -> Result<(), LineError> {
        Ok(())
    }
    fn items(&mut self) -> Result<(), LineError> {
        Ok(())
    }
    fn push(&mut self, _: &mut (), _: ()) -> Result<(), LineError> {
        Ok(())
    }
    fn reuse(&mut self, _: &mut (), _: &(), _: usize) -> Result<(), LineError> {
        Ok(())
    }
    fn array(&mut self, _: (), _: bool) -> Result<(), LineError> {
        Ok(())
    }
    fn object(&mut self, _: Vec<((), ())>, _: usize) -> Result<(), LineError> {
        Ok(())
    }
}

/// How many recent arrays a [`Repeats`] keeps: a prompt continues the previous prompt and the
/// previous answer, so two would do; four tolerate a tool call or an edited turn in between.
const REMEMBERED_ARRAYS: usize = 4;

/// Shorter arrays are not remembered: comparing costs more than parsing them.
const MIN_REMEMBERED_ITEMS: usize = 64;

/// Whether a walk remembers an array of `items` plain non-negative integers. A replay of the
/// walk ([`tape::Replay`]) applies the same rule, so both remember the same arrays.
fn remembers(items: usize) -> bool {
    items >= MIN_REMEMBERED_ITEMS
}

/// Put `item` first among at most `REMEMBERED_ARRAYS` recent ones, dropping the oldest.
fn keep_recent<T>(recent: &mut VecDeque<T>, item: T) {
    if recent.len() == REMEMBERED_ARRAYS {
        recent.pop_back();
    }
    recent.push_front(item);
}

/// Long arrays of plain non-negative integers met earlier in a walk over several lines of one
/// buffer, with what the builder made of them (see the module documentation).
pub struct Repeats<'a, V> {
    arrays: VecDeque<Seen<'a, V>>,
}

/// One remembered array.
struct Seen<'a, V> {
    /// Its bytes from the start of the first item to the end of the last one: digits, commas
    /// and whitespace only, so its commas are exactly its separators.
    text: &'a [u8],
    items: usize,
    value: V,
}

impl<V> Default for Repeats<'_, V> {
    fn default() -> Self {
        Self {
            arrays: VecDeque::new(),
        }
    }
}

impl<'a, V: Clone> Repeats<'a, V> {
    pub fn new() -> Self {
        Self::default()
    }

    /// The remembered arrays, most recent first: `(text, items, value)`.
    pub(crate) fn into_parts(self) -> Vec<(&'a [u8], usize, V)> {
        let parts = self.arrays.into_iter();
        parts
            .map(|seen| (seen.text, seen.items, seen.value))
            .collect()
    }

    /// Repeats remembering `parts` (as [`Repeats::into_parts`] gave them).
    pub(crate) fn from_parts(parts: impl IntoIterator<Item = (&'a [u8], usize, V)>) -> Self {
        let arrays = parts.into_iter();
        Repeats {
            arrays: arrays
                .map(|(text, items, value)| Seen { text, items, value })
                .collect(),
        }
    }

    fn remember(&mut self, text: &'a [u8], items: usize, value: &V) {
        if remembers(items) {
            let value = value.clone();
            keep_recent(&mut self.arrays, Seen { text, items, value });
        }
    }

    /// Take the longest run of whole remembered items that `rest` (the bytes from an array's
    /// first item on) repeats, chaining arrays while each is repeated whole and followed by a
    /// `,`. Appends the items; returns `(items, bytes)` consumed, the bytes ending right after
    /// an item.
    fn reuse<B: Builder<'a, Value = V>>(
        &self,
        rest: &[u8],
        builder: &mut B,
        items: &mut B::Items,
    ) -> Result<(usize, usize), B::Error> {
        let (mut taken, mut consumed) = (0, 0);
        loop {
            let at = if consumed == 0 { 0 } else { consumed + 1 }; // past the ','
            let best = self
                .arrays
                .iter()
                .map(|seen| (seen, seen.shared_items(&rest[at..])))
                .filter(|(_, (count, _))| *count > 0)
                .max_by_key(|(_, (_, len))| *len);
            let Some((seen, (count, len))) = best else {
                return Ok((taken, consumed));
            };
            builder.reuse(items, &seen.value, count)?;
            taken += count;
            consumed = at + len;
            if count < seen.items || rest.get(consumed) != Some(&b',') {
                return Ok((taken, consumed));
            }
        }
    }
}

impl<V> Seen<'_, V> {
    /// `(items, bytes)`: how many whole items of this array `rest` starts with.
    fn shared_items(&self, rest: &[u8]) -> (usize, usize) {
        let same = common_prefix_len(self.text, rest);
        let continues = |at: usize| matches!(rest.get(at), Some(b'0'..=b'9' | b'.' | b'e' | b'E'));
        if same == self.text.len() && !continues(same) {
            return (self.items, same);
        }
        // The run ends at the last separator both share; the item before it is whole in both.
        let Some(comma) = memchr::memrchr(b',', &self.text[..same]) else {
            return (0, 0);
        };
        let end = self.text[..comma]
            .iter()
            .rposition(|b| !matches!(b, b' ' | b'\t' | b'\r' | b'\n'))
            .map_or(0, |last| last + 1);
        (
            memchr::memchr_iter(b',', &self.text[..comma]).count() + 1,
            end,
        )
    }
}

/// Length of the longest common prefix of two byte strings (block compares, then bytes).
fn common_prefix_len(a: &[u8], b: &[u8]) -> usize {
    const BLOCK: usize = 128;
    let n = a.len().min(b.len());
    let mut i = 0;
    while i + BLOCK <= n && a[i..i + BLOCK] == b[i..i + BLOCK] {
        i += BLOCK;
    }
    i + a[i..n]
        .iter()
        .zip(&b[i..n])
        .take_while(|(x, y)| x == y)
        .count()
}

/// Build one JSON document (a whole line) with `builder`, refusing anything after it.
/// `repeats` carries arrays over from earlier lines of the same walk (see [`Repeats`]).
pub fn build<'a, B: Builder<'a>>(
    line: &'a [u8],
    builder: &mut B,
    repeats: Option<&mut Repeats<'a, B::Value>>,
) -> Result<B::Value, B::Error> {
    let mut scan = Scanner::new(line, repeats);
    scan.skip_ws();
    let value = scan.value(builder, 0)?;
    scan.skip_ws();
    if scan.pos != line.len() {
        return Err(scan.error("trailing bytes after the value").into());
    }
    Ok(value)
}

/// Extract the top-level `model_call_id` of one line, validating that the line is exactly one
/// JSON object.
///
/// This is a validating walk, not a parse: it checks the grammar but builds nothing, so the
/// large token arrays cost a pass over their digits (or a compare, with `repeats`) and no
/// allocation. Only the call id is decoded. Whether the object is a valid *entry* is left to the
/// full parse every reader performs.
pub fn extract_call_id<'a>(
    line: &'a [u8],
    repeats: Option<&mut Repeats<'a, ()>>,
) -> Result<String, LineError> {
    let mut scan = Scanner::new(line, repeats);
    scan.skip_ws();
    if scan.peek() != Some(b'{') {
        return Err(scan.error("expected a JSON object"));
    }
    let mut found: Option<String> = None;
    scan.members(0, |scan, key| {
        if key != CALL_ID_KEY {
            return scan.value(&mut Validate, 1);
        }
        let span = if scan.peek() == Some(b'"') {
            Some(scan.string()?.0)
        } else {
            None
        };
        note_call_id(&mut found, span)
    })?;
    scan.skip_ws();
    if scan.pos != line.len() {
        return Err(scan.error("trailing bytes after the object"));
    }
    found_call_id(found)
}

/// The call id's key among an object's members, as a raw span (quotes included): an escaped
/// spelling of it is a different key.
pub(crate) const CALL_ID_KEY: &[u8] = b"\"model_call_id\"";

/// Note a top-level `model_call_id` member whose value is the JSON string `span` (`None`: not
/// a string) in `found`. The rules of [`extract_call_id`] and `tape::call_id_of` alike.
pub(crate) fn note_call_id(
    found: &mut Option<String>,
    span: Option<&[u8]>,
) -> Result<(), LineError> {
    let span = span.ok_or_else(|| LineError("model_call_id is not a string".to_owned()))?;
    let id: String = serde_json::from_slice(span)
        .map_err(|err| LineError(format!("model_call_id is not valid JSON: {err}")))?;
    if found.replace(id).is_some() {
        return Err(LineError("model_call_id appears twice".to_owned()));
    }
    Ok(())
}

/// The call id noted in an object's walk, which must have had one.
pub(crate) fn found_call_id(found: Option<String>) -> Result<String, LineError> {
    found.ok_or_else(|| LineError("no model_call_id".to_owned()))
}

struct Scanner<'a, 'r, V> {
    buf: &'a [u8],
    pos: usize,
    repeats: Option<&'r mut Repeats<'a, V>>,
}

/// Nesting deeper than this is refused rather than walked (the writer refuses far less).
const MAX_DEPTH: usize = 1024;

impl<'a, 'r, V: Clone> Scanner<'a, 'r, V> {
    fn new(buf: &'a [u8], repeats: Option<&'r mut Repeats<'a, V>>) -> Self {
        Self {
            buf,
            pos: 0,
            repeats,
        }
    }

    fn peek(&self) -> Option<u8> {
        self.buf.get(self.pos).copied()
    }

    fn error(&self, what: &str) -> LineError {
        LineError(format!("not a JSON record: {what} at column {}", self.pos))
    }

    fn skip_ws(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t' | b'\r' | b'\n')) {
            self.pos += 1;
        }
    }

    fn literal(&mut self, word: &[u8]) -> Result<(), LineError> {
        if self.buf[self.pos..].starts_with(word) {
            self.pos += word.len();
            Ok(())
        } else {
            Err(self.error("invalid literal"))
        }
    }

    /// One value of any kind.
    fn value<B: Builder<'a, Value = V>>(
        &mut self,
        builder: &mut B,
        depth: usize,
    ) -> Result<V, B::Error> {
        match self.peek() {
            Some(b'"') => {
                let (raw, escaped) = self.string()?;
                builder.string(raw, escaped)
            }
            Some(b'{') => {
                let mut members = Vec::new();
                self.members::<B::Error>(depth + 1, |scan, key| {
                    let escaped = key.contains(&b'\\');
                    let key = builder.string(key, escaped)?;
                    members.push((key, scan.value(builder, depth + 1)?));
                    Ok(())
                })?;
                builder.object(members, depth + 1)
            }
            Some(b'[') => self.array(builder, depth + 1),
            Some(b't') => {
                self.literal(b"true")?;
                builder.boolean(true)
            }
            Some(b'f') => {
                self.literal(b"false")?;
                builder.boolean(false)
            }
            Some(b'n') => {
                self.literal(b"null")?;
                builder.null()
            }
            Some(b'-' | b'0'..=b'9') => {
                let start = self.pos;
                let integer = self.number()?;
                builder.number(&self.buf[start..self.pos], integer)
            }
            _ => Err(self.error("expected a value").into()),
        }
    }

    /// The members of an object starting here; `member` sees each key span (quotes included)
    /// with the scanner at its value, and must consume the value.
    fn members<E: From<LineError>>(
        &mut self,
        depth: usize,
        mut member: impl FnMut(&mut Self, &'a [u8]) -> Result<(), E>,
    ) -> Result<(), E> {
        if depth > MAX_DEPTH {
            return Err(self.error("nesting too deep").into());
        }
        self.pos += 1; // '{'
        self.skip_ws();
        if self.peek() == Some(b'}') {
            self.pos += 1;
            return Ok(());
        }
        loop {
            self.skip_ws();
            if self.peek() != Some(b'"') {
                return Err(self.error("expected a string key").into());
            }
            let (key, _) = self.string()?;
            self.skip_ws();
            if self.peek() != Some(b':') {
                return Err(self.error("expected ':'").into());
            }
            self.pos += 1;
            self.skip_ws();
            member(self, key)?;
            self.skip_ws();
            match self.peek() {
                Some(b',') => self.pos += 1,
                Some(b'}') => {
                    self.pos += 1;
                    return Ok(());
                }
                _ => return Err(self.error("expected ',' or '}'").into()),
            }
        }
    }

    /// The array starting here, built; with `repeats`, a long array of unsigned integers is
    /// remembered and a prefix repeating remembered bytes is reused rather than parsed.
    fn array<B: Builder<'a, Value = V>>(
        &mut self,
        builder: &mut B,
        depth: usize,
    ) -> Result<V, B::Error> {
        if depth > MAX_DEPTH {
            return Err(self.error("nesting too deep").into());
        }
        self.pos += 1; // '['
        self.skip_ws();
        let mut items = builder.items()?;
        if self.peek() == Some(b']') {
            self.pos += 1;
            return builder.array(items, true);
        }
        let first = self.pos;
        let mut count = 0;
        let mut need_item = true;
        if let Some(repeats) = self.repeats.as_deref() {
            let (taken, consumed) = repeats.reuse(&self.buf[first..], builder, &mut items)?;
            (count, need_item) = (taken, taken == 0);
            self.pos += consumed;
        }
        let mut all_unsigned = true;
        let mut last_end = self.pos;
        loop {
            if need_item {
                if !matches!(self.peek(), Some(b'0'..=b'9')) {
                    self.skip_ws();
                }
                // Token arrays are long runs of small non-negative integers: parse those inline.
                let item = match self.unsigned() {
                    Some((value, start)) => builder.unsigned(value, &self.buf[start..self.pos])?,
                    None => {
                        all_unsigned = false;
                        self.value(builder, depth)?
                    }
                };
                builder.push(&mut items, item)?;
                count += 1;
                last_end = self.pos;
            }
            need_item = true;
            if self.peek() != Some(b',') {
                self.skip_ws();
            }
            match self.peek() {
                Some(b',') => self.pos += 1,
                Some(b']') => {
                    self.pos += 1;
                    break;
                }
                _ => return Err(self.error("expected ',' or ']'").into()),
            }
        }
        let value = builder.array(items, all_unsigned)?;
        if all_unsigned {
            if let Some(repeats) = self.repeats.as_deref_mut() {
                repeats.remember(&self.buf[first..last_end], count, &value);
            }
        }
        Ok(value)
    }

    /// A plain non-negative integer of at most 19 digits starting here (so it fits in a u64),
    /// consumed and returned with its start; `None`, consuming nothing, for anything else.
    fn unsigned(&mut self) -> Option<(u64, usize)> {
        let start = self.pos;
        let mut value = 0u64;
        let mut end = start;
        while let Some(&byte) = self.buf.get(end) {
            if !byte.is_ascii_digit() {
                break;
            }
            value = value.wrapping_mul(10).wrapping_add(u64::from(byte - b'0'));
            end += 1;
        }
        let digits = end - start;
        let plain = match digits {
            0 => false,
            1 => true,
            _ => self.buf[start] != b'0' && digits <= 19,
        };
        if !plain || matches!(self.buf.get(end), Some(b'.' | b'e' | b'E')) {
            return None;
        }
        self.pos = end;
        Some((value, start))
    }

    /// `-? (0 | [1-9][0-9]*) (. [0-9]+)? ([eE] [+-]? [0-9]+)?`; true when it is an integer.
    fn number(&mut self) -> Result<bool, LineError> {
        if self.peek() == Some(b'-') {
            self.pos += 1;
        }
        match self.peek() {
            Some(b'0') => self.pos += 1,
            Some(b'1'..=b'9') => self.digits(),
            _ => return Err(self.error("invalid number")),
        }
        let mut integer = true;
        if self.peek() == Some(b'.') {
            integer = false;
            self.pos += 1;
            if !matches!(self.peek(), Some(b'0'..=b'9')) {
                return Err(self.error("invalid number"));
            }
            self.digits();
        }
        if matches!(self.peek(), Some(b'e' | b'E')) {
            integer = false;
            self.pos += 1;
            if matches!(self.peek(), Some(b'+' | b'-')) {
                self.pos += 1;
            }
            if !matches!(self.peek(), Some(b'0'..=b'9')) {
                return Err(self.error("invalid number"));
            }
            self.digits();
        }
        Ok(integer)
    }

    fn digits(&mut self) {
        while matches!(self.peek(), Some(b'0'..=b'9')) {
            self.pos += 1;
        }
    }

    /// The span of a JSON string starting here (quotes included) and whether it holds an
    /// escape: valid UTF-8, no raw control characters, only JSON's escapes.
    fn string(&mut self) -> Result<(&'a [u8], bool), LineError> {
        let start = self.pos;
        let mut escaped = false;
        self.pos += 1; // opening quote
        loop {
            let rest = &self.buf[self.pos..];
            let Some(i) = memchr::memchr2(b'"', b'\\', rest) else {
                return Err(self.error("unterminated string"));
            };
            if rest[..i].iter().any(|&b| b < 0x20) {
                return Err(self.error("control character in a string"));
            }
            self.pos += i + 1;
            if rest[i] == b'"' {
                break;
            }
            escaped = true;
            match self.peek() {
                Some(b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't') => self.pos += 1,
                Some(b'u') => {
                    let hex = self.buf.get(self.pos + 1..self.pos + 5);
                    if !hex.is_some_and(|h| h.iter().all(u8::is_ascii_hexdigit)) {
                        return Err(self.error("invalid \\u escape"));
                    }
                    self.pos += 5;
                }
                _ => return Err(self.error("invalid escape")),
            }
        }
        let span = &self.buf[start..self.pos];
        if std::str::from_utf8(span).is_err() {
            return Err(self.error("string is not valid UTF-8"));
        }
        Ok((span, escaped))
    }
}

#[cfg(test)]
pub(crate) mod tests;
