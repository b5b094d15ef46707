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
pub fn append_line(file: &File, line: &[u8]) -> io::Result<()> {
    append_lines(file, &[line])
}

/// Append each of `lines` followed by a newline, in as few vectored writes as the kernel takes
/// (no copy of the lines), retrying short writes until everything is written. A group commit
/// writes its puts' lines this way before its one fdatasync.
pub fn append_lines(mut file: &File, lines: &[&[u8]]) -> io::Result<()> {
    let newline = [b'\n'];
    let mut slices: Vec<IoSlice<'_>> = lines
        .iter()
        .flat_map(|line| [IoSlice::new(line), IoSlice::new(&newline)])
        .collect();
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

/// Allocate blocks for `file` from `from` to past `end` without changing its size, so that
/// appends up to there find their blocks allocated and their fsync writes no allocation
/// metadata. On this machine's ext4, fsync'ed appends into reserved space ran ~15-20% faster
/// with ~10-18% less kernel CPU. The reservation is invisible to readers (the size is
/// unchanged) and a truncation to the size frees it. Returns the offset reserved up to, or
/// `None` if the filesystem cannot reserve (a caller then stops asking: it only costs speed).
#[cfg(any(target_os = "linux", target_os = "android"))]
pub fn reserve_past(file: &File, from: u64, end: u64) -> Option<u64> {
    // As much again as the log holds, within these bounds.
    const MIN_RESERVE: u64 = 64 << 10;
    const MAX_RESERVE: u64 = 1 << 20;
    let ahead = end.clamp(MIN_RESERVE, MAX_RESERVE);
    let len = end.saturating_sub(from).saturating_add(ahead);
    rustix::fs::fallocate(file, rustix::fs::FallocateFlags::KEEP_SIZE, from, len).ok()?;
    Some(from.saturating_add(len))
}

/// Elsewhere there is no `FALLOC_FL_KEEP_SIZE`: nothing is reserved.
#[cfg(not(any(target_os = "linux", target_os = "android")))]
pub fn reserve_past(_file: &File, _from: u64, _end: u64) -> Option<u64> {
    None
}

/// Allocate exactly `len` bytes of blocks for `file` from `from`, size unchanged (see
/// [`reserve_past`]); whether the filesystem did.
#[cfg(any(target_os = "linux", target_os = "android"))]
pub fn reserve_exactly(file: &File, from: u64, len: u64) -> bool {
    rustix::fs::fallocate(file, rustix::fs::FallocateFlags::KEEP_SIZE, from, len).is_ok()
}

/// Elsewhere nothing is reserved.
#[cfg(not(any(target_os = "linux", target_os = "android")))]
pub fn reserve_exactly(_file: &File, _from: u64, _len: u64) -> bool {
    false
}

/// Read `len` bytes at `offset`.
pub fn read_at(file: &File, offset: u64, len: usize) -> io::Result<Vec<u8>> {
    let mut buf = Vec::new();
    read_into(file, offset, len, &mut buf)?;
    Ok(buf)
}

/// Read `len` bytes at `offset` into `buf` (replacing its contents, reusing its memory).
/// Only bytes beyond what `buf` already holds are zeroed first: a recycled whole-log buffer
/// would otherwise be cleared in full (megabytes) just to be overwritten.
pub fn read_into(file: &File, offset: u64, len: usize, buf: &mut Vec<u8>) -> io::Result<()> {
    zeroed_to(buf, len);
    file.read_exact_at(buf, offset)
}

/// Make `buf` `len` bytes long, to be overwritten. An empty buffer becomes a fresh zeroed
/// allocation (for megabytes, pages the kernel zeroes as they are first touched: no memset of
/// the whole log before it is read over); a reused one grows in place, keeping its pages
/// (zeroing only what it adds).
pub fn zeroed_to(buf: &mut Vec<u8>, len: usize) {
    if buf.capacity() == 0 {
        *buf = vec![0u8; len];
    } else {
        buf.resize(len, 0);
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
