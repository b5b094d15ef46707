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

/// Extract the top-level `model_call_id` of one canonical line.
///
/// This is a structural scan, not a full parse: it walks strings, brackets and separators at
/// about a byte a cycle and does not convert the (huge) token arrays. It checks that the line
/// is exactly one JSON object with balanced structure and a string `model_call_id` at the top
/// level; number syntax inside values is left to the full parse every reader performs.
pub fn extract_call_id(line: &[u8]) -> Result<String, LineError> {
    let mut scan = Scanner { buf: line, pos: 0 };
    scan.skip_ws();
    scan.expect(b'{')?;
    let mut found: Option<String> = None;
    scan.skip_ws();
    if scan.peek() == Some(b'}') {
        scan.pos += 1;
    } else {
        loop {
            scan.skip_ws();
            let key = scan.string_span()?;
            scan.skip_ws();
            scan.expect(b':')?;
            scan.skip_ws();
            if key == b"\"model_call_id\"" {
                let value = scan
                    .string_span()
                    .map_err(|_| LineError("model_call_id is not a string".to_string()))?;
                let id: String = serde_json::from_slice(value)
                    .map_err(|err| LineError(format!("model_call_id is not valid JSON: {err}")))?;
                if found.replace(id).is_some() {
                    return Err(LineError("model_call_id appears twice".to_string()));
                }
            } else {
                scan.skip_value()?;
            }
            scan.skip_ws();
            match scan.next() {
                Some(b',') => continue,
                Some(b'}') => break,
                _ => return Err(scan.error("expected ',' or '}' after a value")),
            }
        }
    }
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

/// Nesting deeper than this is refused rather than scanned (the writer refuses it too).
const MAX_DEPTH: usize = 1024;

impl<'a> Scanner<'a> {
    fn peek(&self) -> Option<u8> {
        self.buf.get(self.pos).copied()
    }

    fn next(&mut self) -> Option<u8> {
        let byte = self.peek()?;
        self.pos += 1;
        Some(byte)
    }

    fn error(&self, what: &str) -> LineError {
        LineError(format!("not a JSON record: {what} at column {}", self.pos))
    }

    fn skip_ws(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t' | b'\r' | b'\n')) {
            self.pos += 1;
        }
    }

    fn expect(&mut self, byte: u8) -> Result<(), LineError> {
        if self.next() == Some(byte) {
            Ok(())
        } else {
            Err(self.error(&format!("expected {:?}", byte as char)))
        }
    }

    /// The span of a JSON string starting here, quotes included.
    fn string_span(&mut self) -> Result<&'a [u8], LineError> {
        let start = self.pos;
        self.expect(b'"')?;
        loop {
            let rest = &self.buf[self.pos..];
            match memchr::memchr2(b'"', b'\\', rest) {
                None => return Err(self.error("unterminated string")),
                Some(i) if rest[i] == b'"' => {
                    self.pos += i + 1;
                    return Ok(&self.buf[start..self.pos]);
                }
                Some(i) if self.pos + i + 2 > self.buf.len() => {
                    return Err(self.error("unterminated escape"));
                }
                Some(i) => self.pos += i + 2, // skip the escaped byte
            }
        }
    }

    /// Skip one value: a string, a balanced array/object, or a scalar token.
    fn skip_value(&mut self) -> Result<(), LineError> {
        match self.peek() {
            Some(b'"') => self.string_span().map(|_| ()),
            Some(b'[' | b'{') => self.skip_container(),
            Some(_) => {
                let start = self.pos;
                while let Some(byte) = self.peek() {
                    if matches!(byte, b',' | b'}' | b']' | b' ' | b'\t' | b'\r' | b'\n') {
                        break;
                    }
                    if matches!(byte, b'"' | b'[' | b'{' | b':') {
                        return Err(self.error("malformed scalar"));
                    }
                    self.pos += 1;
                }
                if self.pos == start {
                    Err(self.error("missing value"))
                } else {
                    Ok(())
                }
            }
            None => Err(self.error("missing value")),
        }
    }

    fn skip_container(&mut self) -> Result<(), LineError> {
        let mut stack: Vec<u8> = Vec::new();
        loop {
            let Some(byte) = self.peek() else {
                return Err(self.error("unbalanced brackets"));
            };
            match byte {
                b'"' => {
                    self.string_span()?;
                    continue;
                }
                b'[' => stack.push(b']'),
                b'{' => stack.push(b'}'),
                b']' | b'}' => {
                    if stack.pop() != Some(byte) {
                        return Err(self.error("mismatched bracket"));
                    }
                    if stack.is_empty() {
                        self.pos += 1;
                        return Ok(());
                    }
                }
                _ => {}
            }
            if stack.len() > MAX_DEPTH {
                return Err(self.error("nesting too deep"));
            }
            self.pos += 1;
        }
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
        let line = br#"{"custom":{"model_call_id":"nested"},"model_call_id":"call-\"1\"","x":[1,2,{"y":"}"}]}"#;
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
        ] {
            assert!(
                extract_call_id(bad).is_err(),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
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
