//! One rollout's JSONL log: append with fsync, and the scan that recovers it.
//!
//! Recovery rules (the heart of the format):
//! * A put writes its line and the newline in one `write` and fsyncs before it returns, so
//!   a final line without its newline was never acknowledged. It is a *torn* write, whether or
//!   not it parses: readers ignore it and a writer truncates it away under the exclusive lock
//!   (appending after it would glue the next record onto it).
//! * Every newline-terminated line was acknowledged. One that is not a JSON object with a
//!   string `model_call_id` is corruption: the scan raises with the file and byte offset and
//!   never skips it.

use std::fs::File;
use std::io::{self, IoSlice, Write};
use std::os::unix::fs::FileExt;

/// One complete line of a log buffer: its byte range (without the newline) and its call id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogLine {
    pub offset: u64,
    pub len: usize,
    pub call_id: String,
}

/// Length of the prefix of `buf` made of complete (newline-terminated) lines.
pub fn complete_prefix_len(buf: &[u8]) -> usize {
    memchr::memrchr(b'\n', buf).map_or(0, |i| i + 1)
}

/// Iterate the complete lines of `buf` (whose first byte sits at file offset `base`), yielding
/// `(offset, line_without_newline)`. Bytes after the last newline are not yielded.
pub fn complete_lines(buf: &[u8], base: u64) -> impl Iterator<Item = (u64, &[u8])> {
    let complete = &buf[..complete_prefix_len(buf)];
    let mut start = 0usize;
    memchr::memchr_iter(b'\n', complete).map(move |end| {
        let line = &complete[start..end];
        let offset = base + start as u64;
        start = end + 1;
        (offset, line)
    })
}

/// Append `line` and a newline in one vectored write (no copy of large lines), retrying short
/// writes until everything is written.
pub fn append_line(mut file: &File, line: &[u8]) -> io::Result<()> {
    let newline = [b'\n'];
    let mut slices = [IoSlice::new(line), IoSlice::new(&newline)];
    let mut pending: &mut [IoSlice<'_>] = &mut slices;
    while !pending.is_empty() {
        match file.write_vectored(pending) {
            Ok(0) => return Err(io::Error::new(io::ErrorKind::WriteZero, "wrote 0 bytes")),
            Ok(n) => IoSlice::advance_slices(&mut pending, n),
            Err(err) if err.kind() == io::ErrorKind::Interrupted => {}
            Err(err) => return Err(err),
        }
    }
    Ok(())
}

/// Read `len` bytes at `offset`.
pub fn read_at(file: &File, offset: u64, len: usize) -> io::Result<Vec<u8>> {
    let mut buf = vec![0u8; len];
    file.read_exact_at(&mut buf, offset)?;
    Ok(buf)
}

/// Why a line is not a record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LineError(pub String);

/// Receives the values of a JSON document as the validating walk meets them.
///
/// The walk owns the grammar; a builder decides what a value becomes. [`Validate`] builds
/// nothing (its values are `()`, so arrays of them never allocate); the Python binding builds
/// Python objects straight from the bytes, with no intermediate tree.
pub trait Builder {
    type Value;
    type Error: From<LineError>;

    fn null(&mut self) -> Result<Self::Value, Self::Error>;
    fn boolean(&mut self, value: bool) -> Result<Self::Value, Self::Error>;
    /// `text` is a valid JSON number; `integer` when it has no fraction or exponent.
    fn number(&mut self, text: &[u8], integer: bool) -> Result<Self::Value, Self::Error>;
    /// A non-negative integer that fits in a u64 (`text` is its digits): the common case of
    /// token ids, handed over already parsed.
    fn unsigned(&mut self, value: u64, text: &[u8]) -> Result<Self::Value, Self::Error> {
        let _ = value;
        self.number(text, true)
    }
    /// `raw` is a valid JSON string with its quotes; `escaped` when it contains a backslash.
    fn string(&mut self, raw: &[u8], escaped: bool) -> Result<Self::Value, Self::Error>;
    /// `all_unsigned` when every item was a non-negative integer (handed to `unsigned`).
    fn array(
        &mut self,
        items: Vec<Self::Value>,
        all_unsigned: bool,
    ) -> Result<Self::Value, Self::Error>;
    /// `depth` is 1 for the top-level object of a line.
    fn object(
        &mut self,
        members: Vec<(Self::Value, Self::Value)>,
        depth: usize,
    ) -> Result<Self::Value, Self::Error>;
}

/// The builder that only validates.
pub struct Validate;

impl Builder for Validate {
    type Value = ();
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
    fn array(&mut self, _: Vec<()>, _: bool) -> Result<(), LineError> {
        Ok(())
    }
    fn object(&mut self, _: Vec<((), ())>, _: usize) -> Result<(), LineError> {
        Ok(())
    }
}

/// Build one JSON document (a whole line) with `builder`, refusing anything after it.
pub fn build<B: Builder>(line: &[u8], builder: &mut B) -> Result<B::Value, B::Error> {
    let mut scan = Scanner { buf: line, pos: 0 };
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
/// This is a validating walk, not a parse: it checks the JSON grammar (strings, escapes and
/// UTF-8, numbers, literals, separators, nesting) byte by byte but builds nothing, so the large
/// token arrays cost a pass over their digits and no allocation. Only the call id is decoded.
/// Whether the object is a valid *entry* is left to the full parse every reader performs.
pub fn extract_call_id(line: &[u8]) -> Result<String, LineError> {
    let mut scan = Scanner { buf: line, pos: 0 };
    scan.skip_ws();
    if scan.peek() != Some(b'{') {
        return Err(scan.error("expected a JSON object"));
    }
    let mut found: Option<String> = None;
    scan.members(0, |scan, key| {
        if key != b"\"model_call_id\"" {
            return scan.value(&mut Validate, 1);
        }
        if scan.peek() != Some(b'"') {
            return Err(LineError("model_call_id is not a string".to_string()));
        }
        let (span, _) = scan.string()?;
        let id: String = serde_json::from_slice(span)
            .map_err(|err| LineError(format!("model_call_id is not valid JSON: {err}")))?;
        if found.replace(id).is_some() {
            return Err(LineError("model_call_id appears twice".to_string()));
        }
        Ok(())
    })?;
    scan.skip_ws();
    if scan.pos != line.len() {
        return Err(scan.error("trailing bytes after the object"));
    }
    found.ok_or_else(|| LineError("no model_call_id".to_string()))
}

struct Scanner<'a> {
    buf: &'a [u8],
    pos: usize,
}

/// Nesting deeper than this is refused rather than walked (the writer refuses far less).
const MAX_DEPTH: usize = 1024;

impl<'a> Scanner<'a> {
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
    fn value<B: Builder>(&mut self, builder: &mut B, depth: usize) -> Result<B::Value, B::Error> {
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
            Some(b'[') => {
                let (items, all_unsigned) = self.items(builder, depth + 1)?;
                builder.array(items, all_unsigned)
            }
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

    fn items<B: Builder>(
        &mut self,
        builder: &mut B,
        depth: usize,
    ) -> Result<(Vec<B::Value>, bool), B::Error> {
        if depth > MAX_DEPTH {
            return Err(self.error("nesting too deep").into());
        }
        self.pos += 1; // '['
        self.skip_ws();
        let mut items = Vec::new();
        let mut all_unsigned = true;
        if self.peek() == Some(b']') {
            self.pos += 1;
            return Ok((items, all_unsigned));
        }
        loop {
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
            items.push(item);
            if self.peek() != Some(b',') {
                self.skip_ws();
            }
            match self.peek() {
                Some(b',') => self.pos += 1,
                Some(b']') => {
                    self.pos += 1;
                    return Ok((items, all_unsigned));
                }
                _ => return Err(self.error("expected ',' or ']'").into()),
            }
        }
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
mod tests {
    use super::*;

    #[test]
    fn complete_lines_skip_the_torn_tail() {
        let buf = b"{\"a\":1}\n{\"b\":2}\n{\"c\":";
        let lines: Vec<_> = complete_lines(buf, 100).collect();
        assert_eq!(
            lines,
            vec![(100, &b"{\"a\":1}"[..]), (108, &b"{\"b\":2}"[..])]
        );
        assert_eq!(complete_prefix_len(buf), 16);
        assert_eq!(complete_prefix_len(b"torn"), 0);
    }

    #[test]
    fn extracts_the_top_level_call_id_only() {
        let line = br#"{"custom":{"model_call_id":"nested"},"model_call_id":"call-\"1\"","x":[1,2,{"y":"}"}],"f":-1.5e-3,"t":[true,false,null,0,"\u00e9\n"]}"#;
        assert_eq!(extract_call_id(line).unwrap(), "call-\"1\"");
        let unicode = r#"{"model_call_id":"caf\u00e9-é"}"#;
        assert_eq!(extract_call_id(unicode.as_bytes()).unwrap(), "café-é");
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
                extract_call_id(bad).is_err(),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    /// Builds a compact re-serialization, to see the walk hands every value over in order.
    struct Echo;

    impl Builder for Echo {
        type Value = String;
        type Error = LineError;
        fn null(&mut self) -> Result<String, LineError> {
            Ok("null".into())
        }
        fn boolean(&mut self, value: bool) -> Result<String, LineError> {
            Ok(value.to_string())
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
        fn array(&mut self, items: Vec<String>, all_unsigned: bool) -> Result<String, LineError> {
            let mark = if all_unsigned { "u" } else { "" };
            Ok(format!("{mark}[{}]", items.join(",")))
        }
        fn object(
            &mut self,
            members: Vec<(String, String)>,
            _: usize,
        ) -> Result<String, LineError> {
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
            build(line, &mut Echo).unwrap(),
            r#"{"a":[i1,f-2.5e3,true,null,e"x\ny"],"b":{}}"#
        );
        assert!(build(b"[1] 2", &mut Echo).is_err());
        assert!(build(b"[01]", &mut Validate).is_err());
    }

    #[test]
    fn append_line_writes_line_and_newline() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.jsonl");
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .read(true)
            .open(&path)
            .unwrap();
        append_line(&file, b"{\"model_call_id\":\"a\"}").unwrap();
        append_line(&file, b"{\"model_call_id\":\"b\"}").unwrap();
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(
            bytes,
            b"{\"model_call_id\":\"a\"}\n{\"model_call_id\":\"b\"}\n"
        );
        assert_eq!(
            read_at(&file, 22, 21).unwrap(),
            b"{\"model_call_id\":\"b\"}"
        );
    }
}
