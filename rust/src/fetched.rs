//! Logs fetched whole from another backend. The PostgreSQL store keeps each entry's canonical
//! line and payload digest in a row and hands a rollout's lines back one by one (or joined into
//! one buffer of newline-terminated lines) with the digests beside them; here the lines are
//! checked against those digests, walked for their call ids, and handed to a decoder exactly as
//! the file store hands its log's lines to one ([`Store::read_decoding`]), so both backends share
//! one decoder (the Python objects of `py/decode.rs`, the Arrow columns of [`crate::columnar`]).
//!
//! Byte offsets (in refusals and in the ranges returned) are those of the lines joined into one
//! log, each followed by its newline, whichever form the lines came in.
//!
//! [`Store::read_decoding`]: crate::store::Store::read_decoding

use std::ops::Range;
use std::path::Path;
use std::sync::mpsc::TrySendError;

use crate::digest::{payload_digests, SharedDigests};
use crate::error::{Error, Result};
use crate::json::tape::{call_id_of, tape_channel, LineTape, LineTaper};
use crate::json::{extract_call_id, LineError, Repeats};
use crate::log::complete_lines;
use crate::ring::LineBytes;
use crate::store::{first_records, LinesToDecode, Records, PARALLEL_SCAN_BYTES, TAPES_AHEAD};

/// What [`decode_fetched`] and [`decode_fetched_lines`] return: the records (the first line of
/// each call id, in order; `buf` is left empty, the ranges index the joined log), the ranges of
/// every line (which `decode` saw, in order) and what `decode` made of them.
pub type Fetched<D> = (Records, Vec<Range<usize>>, D);

/// A fetched log in either form a caller holds it: one buffer of newline-terminated lines, or
/// the lines apart (without their newlines), as rows hand them over.
#[derive(Debug, Clone, Copy)]
pub enum FetchedLog<'a> {
    Joined(&'a [u8]),
    Lines(&'a [&'a [u8]]),
}

impl FetchedLog<'_> {
    /// [`decode_fetched`] or [`decode_fetched_lines`], as the form asks.
    pub fn decode<D>(
        self,
        digests: Option<&[String]>,
        source: &Path,
        decode: impl for<'b> FnOnce(LinesToDecode<'b>) -> D,
    ) -> Result<Fetched<D>> {
        match self {
            FetchedLog::Joined(buf) => decode_fetched(buf, digests, source, decode),
            FetchedLog::Lines(lines) => decode_fetched_lines(lines, digests, source, decode),
        }
    }
}

/// [`decode_fetched_lines`] of a buffer of complete lines (each with its newline); a final line
/// without its newline is refused first.
pub fn decode_fetched<D>(
    buf: &[u8],
    digests: Option<&[String]>,
    source: &Path,
    decode: impl for<'b> FnOnce(LinesToDecode<'b>) -> D,
) -> Result<Fetched<D>> {
    let lines: Vec<&[u8]> = complete_lines(buf, 0).map(|(_, line)| line).collect();
    let complete_end: usize = lines.iter().map(|line| line.len() + 1).sum();
    if complete_end != buf.len() {
        let detail = "the last line has no newline: the log is not made of whole lines";
        return Err(Error::corrupt(source, complete_end as u64, detail));
    }
    decode_fetched_lines(&lines, digests, source, decode)
}

/// Check `lines` (each without its newline, with its stored payload digest in `digests` when
/// given) and decode them with `decode`, as [`Store::read_decoding`] does for a log file.
/// Offsets are those of the lines joined into one log (line `k` starts at the sum of the lengths
/// of the lines before it, plus one newline each). Refusals are corruption errors naming `source`
/// and such an offset, in this order: a digest count other than the line count, a line holding
/// a newline byte, a line that does not match its digest, a line without a call id (worded as
/// the file store words it). Lines totalling at least 256 KiB are walked into tapes on a second
/// thread while `decode` builds, and hashed on a third (and by whichever thread would otherwise
/// wait), as the file store's large reads are; smaller ones are copied into one buffer first.
///
/// [`Store::read_decoding`]: crate::store::Store::read_decoding
pub fn decode_fetched_lines<D>(
    lines: &[&[u8]],
    digests: Option<&[String]>,
    source: &Path,
    decode: impl for<'b> FnOnce(LinesToDecode<'b>) -> D,
) -> Result<Fetched<D>> {
    if let Some(digests) = digests {
        if digests.len() != lines.len() {
            let detail = format!(
                "the log holds {} lines but {} payload digests were stored with them",
                lines.len(),
                digests.len()
            );
            return Err(Error::corrupt(source, 0, detail));
        }
    }
    let mut end = 0;
    let lines: Vec<(u64, &[u8])> = lines
        .iter()
        .map(|&line| {
            let offset = end;
            end += line.len() + 1;
            (offset as u64, line)
        })
        .collect();
    let ranges: Vec<Range<usize>> = lines
        .iter()
        .map(|&(offset, line)| offset as usize..offset as usize + line.len())
        .collect();
    if end < PARALLEL_SCAN_BYTES {
        if let Some(index) = lines.iter().position(|&(_, line)| holds_newline(line)) {
            return Err(newline_in(source, lines[index]));
        }
        let hashed: Option<Vec<String>> =
            digests.map(|_| payload_digests(lines.iter().map(|&(_, line)| line)));
        let mut repeats = Repeats::new();
        let call_ids: Vec<_> = lines
            .iter()
            .map(|&(_, line)| extract_call_id(line, Some(&mut repeats)))
            .collect();
        let records = check(source, &lines, digests.zip(hashed), call_ids)?;
        // A small log: one buffer laid out as the joined log (a cheap copy).
        let mut buf = Vec::with_capacity(end);
        for &(_, line) in &lines {
            buf.extend_from_slice(line);
            buf.push(b'\n');
        }
        let decoded = decode(LinesToDecode::Whole {
            buf: &buf,
            lines: &ranges,
        });
        return Ok((records, ranges, decoded));
    }
    let to_hash = match digests {
        Some(_) => lines.iter().map(|&(_, line)| line).collect(),
        None => Vec::new(),
    };
    let hashing = SharedDigests::new(to_hash);
    let ((call_ids, split), decoded) = std::thread::scope(|scope| {
        let (sink, feed) = tape_channel(TAPES_AHEAD);
        let (lines, hashing) = (&lines, &hashing);
        let walking = scope.spawn(move || {
            let mut taper = LineTaper::new();
            let mut call_ids = Vec::with_capacity(lines.len());
            // The first line holding a newline byte (checked here, off the building thread).
            let mut split = None;
            for (index, &(_, line)) in lines.iter().enumerate() {
                if split.is_none() && holds_newline(line) {
                    split = Some(index);
                }
                taper.floats_as_text(sink.floats_as_text());
                let tape = taper.tape(line);
                call_ids.push(call_id_of(line, &tape));
                let mut item = LineTape {
                    line: LineBytes::Borrowed(line),
                    tape,
                };
                loop {
                    match sink.try_send(item) {
                        Ok(()) | Err(TrySendError::Disconnected(_)) => break,
                        // The decoder is behind: hash a line meanwhile.
                        Err(TrySendError::Full(back)) if hashing.help() => item = back,
                        Err(TrySendError::Full(back)) => {
                            sink.send(back);
                            break;
                        }
                    }
                }
            }
            drop(sink); // every line is sent: `decode` may finish and help hash
            (call_ids, split)
        });
        // A third thread hashes from the start: the walk and the build are each shorter than
        // the hashing of a large log, so hashing only when idle left it for the end.
        let hasher = scope.spawn(move || while hashing.help() {});
        let decoded = decode(LinesToDecode::Taped(feed));
        while hashing.help() {}
        hasher.join().expect("hashing thread");
        (walking.join().expect("walking thread"), decoded)
    });
    if let Some(index) = split {
        return Err(newline_in(source, lines[index]));
    }
    let hashed = digests.map(|_| hashing.collect());
    let records = check(source, &lines, digests.zip(hashed), call_ids)?;
    Ok((records, ranges, decoded))
}

/// `(offset, length)` of each of `lines`.
fn lengths(lines: &[(u64, &[u8])]) -> Vec<(u64, usize)> {
    lines
        .iter()
        .map(|&(offset, line)| (offset, line.len()))
        .collect()
}

fn holds_newline(line: &[u8]) -> bool {
    memchr::memchr(b'\n', line).is_some()
}

/// The refusal of a line (at `offset` in the joined log) that holds a newline byte: joined, it
/// would be two lines.
fn newline_in(source: &Path, (offset, line): (u64, &[u8])) -> Error {
    let column = memchr::memchr(b'\n', line).unwrap_or(0);
    let detail =
        format!("the line holds a newline at column {column}: a stored line must be one line");
    Error::corrupt(source, offset, detail)
}

/// Every line against its stored digest (`(stored, hashed)`), then the first line of each call
/// id (a line without one is corruption, as in the file store).
fn check(
    source: &Path,
    lines: &[(u64, &[u8])],
    digests: Option<(&[String], Vec<String>)>,
    call_ids: Vec<std::result::Result<String, LineError>>,
) -> Result<Records> {
    if let Some((stored, hashed)) = digests {
        for ((&(offset, _), stored), hashed) in lines.iter().zip(stored).zip(&hashed) {
            if stored != hashed {
                let detail = format!("the line does not match its payload digest {stored}");
                return Err(Error::corrupt(source, offset, detail));
            }
        }
    }
    Ok(Records {
        buf: Vec::new(),
        lines: first_records(source, &lengths(lines), call_ids)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ranges_seen(lines: LinesToDecode<'_>) -> Vec<Vec<u8>> {
        match lines {
            LinesToDecode::Whole { buf, lines } => lines
                .iter()
                .map(|range| buf[range.clone()].to_vec())
                .collect(),
            LinesToDecode::Taped(feed) => feed
                .iter()
                .map(|taped| {
                    assert!(taped.tape.is_ok());
                    taped.line().to_vec()
                })
                .collect(),
        }
    }

    /// Lines of growing prompts (repeated runs), `bytes` long at least.
    fn log_of(bytes: usize) -> (Vec<u8>, Vec<String>) {
        let (mut log, mut digests, mut prompt) = (Vec::new(), Vec::new(), Vec::new());
        let mut call = 0;
        while log.len() < bytes {
            prompt.extend((0..500).map(|i| ((call * 7919 + i * 104_729) % 151_936).to_string()));
            let line = format!(
                r#"{{"model_call_id":"c{call}","prompt_token_ids":[{}]}}"#,
                prompt.join(",")
            );
            digests.push(crate::digest::sha256_hex(line.as_bytes()));
            log.extend_from_slice(line.as_bytes());
            log.push(b'\n');
            call += 1;
        }
        (log, digests)
    }

    /// The lines of `log` as separate slices (as rows hand them over).
    fn split(log: &[u8]) -> Vec<&[u8]> {
        let mut lines: Vec<&[u8]> = log.split(|&b| b == b'\n').collect();
        assert_eq!(lines.pop(), Some(&b""[..]));
        lines
    }

    #[test]
    fn small_and_large_logs_hand_every_line_to_the_decoder() {
        for bytes in [10_000, 3 * PARALLEL_SCAN_BYTES] {
            let (log, digests) = log_of(bytes);
            let expected: Vec<Vec<u8>> = split(&log).iter().map(|l| l.to_vec()).collect();
            // The ranges of the lines in the joined log, counted here by hand.
            let mut start = 0;
            let expected_ranges: Vec<Range<usize>> = expected
                .iter()
                .map(|line| {
                    let range = start..start + line.len();
                    start = range.end + 1;
                    range
                })
                .collect();
            assert_eq!(start, log.len());
            let (records, ranges, seen) =
                decode_fetched(&log, Some(&digests), Path::new("x"), ranges_seen).unwrap();
            assert_eq!(seen, expected);
            assert_eq!(ranges, expected_ranges);
            assert_eq!(records.lines, ranges);
            let (records, ranges, seen) =
                decode_fetched_lines(&split(&log), Some(&digests), Path::new("x"), ranges_seen)
                    .unwrap();
            assert_eq!(seen, expected);
            assert_eq!(ranges, expected_ranges);
            assert_eq!(records.lines, ranges);
            assert_eq!(ranges.len(), digests.len());
        }
    }

    #[test]
    fn refusals_name_the_source_and_offset() {
        for bytes in [10_000, 3 * PARALLEL_SCAN_BYTES] {
            let (log, mut digests) = log_of(bytes);
            let lines = split(&log);
            let second = lines[0].len() + 1;
            let torn = &log[..log.len() - 1];
            let err = decode_fetched(torn, None, Path::new("src"), |_| ()).unwrap_err();
            assert_eq!(
                err.to_string(),
                format!(
                    "src: the last line has no newline: the log is not made of whole lines \
                     (byte offset {})",
                    log.len() - 1 - lines.last().unwrap().len()
                )
            );
            let count = format!(
                "src: the log holds {} lines but {} payload digests were stored with them \
                 (byte offset 0)",
                lines.len(),
                lines.len() - 1
            );
            let err = decode_fetched(&log, Some(&digests[1..]), Path::new("src"), |_| ());
            assert_eq!(err.unwrap_err().to_string(), count);
            let err = decode_fetched_lines(&lines, Some(&digests[1..]), Path::new("src"), |_| ());
            assert_eq!(err.unwrap_err().to_string(), count);
            digests[1] = "0".repeat(64);
            let mismatch = format!(
                "src: the line does not match its payload digest {} (byte offset {second})",
                digests[1]
            );
            let err = decode_fetched(&log, Some(&digests), Path::new("src"), |_| ()).unwrap_err();
            assert_eq!(err.to_string(), mismatch);
            let err = decode_fetched_lines(&lines, Some(&digests), Path::new("src"), |_| ());
            assert_eq!(err.unwrap_err().to_string(), mismatch);
            // The last line's digest: its offset is the joined log's.
            let last = lines.len() - 1;
            let (_, mut digests) = log_of(bytes);
            digests[last] = "1".repeat(64);
            let err = decode_fetched_lines(&lines, Some(&digests), Path::new("src"), |_| ());
            assert_eq!(
                err.unwrap_err().to_string(),
                format!(
                    "src: the line does not match its payload digest {} (byte offset {})",
                    digests[last],
                    log.len() - lines[last].len() - 1
                )
            );
        }
    }

    #[test]
    fn a_line_holding_a_newline_is_corruption() {
        for bytes in [10_000, 3 * PARALLEL_SCAN_BYTES] {
            let (log, digests) = log_of(bytes);
            let lines = split(&log);
            // The second line with a newline byte in place of its 6th, its digest recomputed (the
            // digest check cannot catch it), and the last line split the same way.
            let last = lines.len() - 1;
            let (mut second, mut final_line) = (lines[1].to_vec(), lines[last].to_vec());
            second[5] = b'\n';
            final_line[9] = b'\n';
            let mut damaged = lines.clone();
            damaged[1] = &second;
            damaged[last] = &final_line;
            let mut digests = digests.clone();
            digests[1] = crate::digest::sha256_hex(&second);
            digests[last] = crate::digest::sha256_hex(&final_line);
            let offset = lines[0].len() + 1;
            let expected = format!(
                "src: the line holds a newline at column 5: a stored line must be one line \
                 (byte offset {offset})"
            );
            for digests in [None, Some(&digests[..])] {
                let err = decode_fetched_lines(&damaged, digests, Path::new("src"), |_| ());
                assert_eq!(err.unwrap_err().to_string(), expected);
            }
        }
    }

    #[test]
    fn a_repeated_call_id_keeps_its_first_line() {
        let log = b"{\"model_call_id\":\"a\",\"x\":1}\n{\"model_call_id\":\"a\",\"x\":2}\n";
        let (records, ranges, ()) = decode_fetched(log, None, Path::new("s"), |_| ()).unwrap();
        assert_eq!(ranges.len(), 2);
        assert_eq!(records.lines, vec![ranges[0].clone()]);
        let err = decode_fetched(b"[1]\n", None, Path::new("s"), |_| ()).unwrap_err();
        assert_eq!(
            err.to_string(),
            "s: not a JSON record: expected a JSON object at column 0 (byte offset 0)"
        );
    }
}
