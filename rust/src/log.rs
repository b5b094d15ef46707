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

/// Fill `buf` from the start of `file` in chunks, handing each complete line to `each_line`
/// (`offset`, line without its newline) as soon as its newline has been read, so a consumer
/// can work on the first lines while the rest is still being read. Returns the bytes after the
/// last newline (a torn tail, usually empty). A file shorter than `buf` is an error, as
/// `read_exact_at` would make it.
pub fn read_lines_streaming<'b>(
    file: &File,
    buf: &'b mut [u8],
    mut each_line: impl FnMut(u64, &'b [u8]),
) -> io::Result<&'b [u8]> {
    // The first chunk is small so that the first lines go out at once.
    const FIRST_CHUNK: usize = 64 << 10;
    const CHUNK: usize = 512 << 10;
    let mut rest = buf;
    let mut base = 0u64; // the file offset of `rest[0]`
    let mut filled = 0; // bytes of `rest` read, all past its last complete line
    let mut chunk = FIRST_CHUNK;
    while filled < rest.len() {
        let end = rest.len().min(filled + chunk);
        let read = match file.read_at(&mut rest[filled..end], base + filled as u64) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(read) => read,
            Err(err) if err.kind() == io::ErrorKind::Interrupted => continue,
            Err(err) => return Err(err),
        };
        let new = filled..filled + read;
        filled += read;
        chunk = CHUNK;
        if let Some(last) = memchr::memrchr(b'\n', &rest[new.clone()]) {
            // Split the complete lines off: shared from now on, while the rest is written.
            let cut = new.start + last + 1;
            let (done, tail) = std::mem::take(&mut rest).split_at_mut(cut);
            for (offset, line) in complete_lines(done, base) {
                each_line(offset, line);
            }
            rest = tail;
            base += cut as u64;
            filled -= cut;
        }
    }
    Ok(rest)
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
    fn streaming_reads_hand_out_every_complete_line_once_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.jsonl");
        // Lines shorter and longer than a chunk, one empty, and a torn tail.
        let mut content = Vec::new();
        for (i, len) in [3usize, 0, 70_000, 10, 600_000, 1, 200_000]
            .iter()
            .enumerate()
        {
            content.extend(std::iter::repeat_n(b'a' + i as u8, *len));
            content.push(b'\n');
        }
        for torn in [&b""[..], b"{\"torn"] {
            let mut bytes = content.clone();
            bytes.extend_from_slice(torn);
            std::fs::write(&path, &bytes).unwrap();
            let file = File::open(&path).unwrap();
            let mut buf = vec![0u8; bytes.len()];
            let mut seen = Vec::new();
            let tail = read_lines_streaming(&file, &mut buf, |offset, line| {
                seen.push((offset, line.to_vec()));
            })
            .unwrap();
            assert_eq!(tail, torn);
            let expected: Vec<(u64, Vec<u8>)> = complete_lines(&bytes, 0)
                .map(|(offset, line)| (offset, line.to_vec()))
                .collect();
            assert_eq!(seen, expected);
            assert_eq!(buf, bytes);
        }
        // A file shorter than the buffer is an error, not a silent short read.
        let file = File::open(&path).unwrap();
        let mut buf = vec![0u8; content.len() + 100];
        let err = read_lines_streaming(&file, &mut buf, |_, _| {}).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof);
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
