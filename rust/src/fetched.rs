//! Logs fetched whole from another backend. The PostgreSQL store keeps each entry's canonical
//! line and payload digest in a row and hands a rollout's lines back as one buffer of
//! newline-terminated lines with the digests beside it; here the lines are checked against those
//! digests, walked for their call ids, and handed to a decoder exactly as the file store hands
//! its log's lines to one ([`Store::read_decoding`]), so both backends share one decoder (the
//! Python objects of `py/decode.rs`, the Arrow columns of [`crate::columnar`]).
//!
//! [`Store::read_decoding`]: crate::store::Store::read_decoding

use std::ops::Range;
use std::path::Path;
use std::sync::mpsc::TrySendError;

use crate::digest::{payload_digest, SharedDigests};
use crate::error::{Error, Result};
use crate::json::tape::{call_id_of, tape_channel, LineTape, LineTaper};
use crate::json::{extract_call_id, LineError, Repeats};
use crate::log::complete_lines;
use crate::store::{first_records, LinesToDecode, Records, PARALLEL_SCAN_BYTES, TAPES_AHEAD};

/// Check `buf` (complete lines, each with its stored payload digest in `digests` when given) and
/// decode its lines with `decode`, as [`Store::read_decoding`] does for a log file: returns the
/// records (the first line of each call id, in order; `buf` is left empty, the ranges index the
/// caller's buffer), the ranges of every line (which `decode` saw, in order) and what `decode`
/// made of them. Refusals are corruption errors naming `source` and a byte offset in `buf`: a
/// final line without its newline, a digest count other than the line count, a line that does
/// not match its digest, a line without a call id (worded as the file store words it). A buffer
/// of at least 256 KiB is walked into tapes on a second thread while `decode` builds (and the
/// hashing goes to whichever thread would otherwise wait), as the file store's large reads are.
///
/// [`Store::read_decoding`]: crate::store::Store::read_decoding
pub fn decode_fetched<D>(
    buf: &[u8],
    digests: Option<&[String]>,
    source: &Path,
    decode: impl for<'b> FnOnce(LinesToDecode<'b>) -> D,
) -> Result<(Records, Vec<Range<usize>>, D)> {
    let lines: Vec<(u64, &[u8])> = complete_lines(buf, 0).collect();
    let complete_end = lines
        .last()
        .map_or(0, |&(offset, line)| offset + line.len() as u64 + 1);
    if complete_end != buf.len() as u64 {
        let detail = "the last line has no newline: the log is not made of whole lines";
        return Err(Error::corrupt(source, complete_end, detail));
    }
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
    let ranges: Vec<Range<usize>> = lines
        .iter()
        .map(|&(offset, line)| offset as usize..offset as usize + line.len())
        .collect();
    if buf.len() < PARALLEL_SCAN_BYTES {
        let hashed: Option<Vec<String>> = digests.map(|_| {
            lines
                .iter()
                .map(|&(_, line)| payload_digest(line))
                .collect()
        });
        let mut repeats = Repeats::new();
        let call_ids: Vec<_> = lines
            .iter()
            .map(|&(_, line)| extract_call_id(line, Some(&mut repeats)))
            .collect();
        let records = check(source, &lines, digests.zip(hashed), call_ids)?;
        let decoded = decode(LinesToDecode::Whole {
            buf,
            lines: &ranges,
        });
        return Ok((records, ranges, decoded));
    }
    let to_hash = match digests {
        Some(_) => lines.iter().map(|&(_, line)| line).collect(),
        None => Vec::new(),
    };
    let hashing = SharedDigests::new(to_hash);
    let (call_ids, decoded) = std::thread::scope(|scope| {
        let (sink, feed) = tape_channel(TAPES_AHEAD);
        let (lines, hashing) = (&lines, &hashing);
        let walking = scope.spawn(move || {
            let mut taper = LineTaper::new();
            let mut call_ids = Vec::with_capacity(lines.len());
            for &(_, line) in lines {
                let tape = taper.tape(line);
                call_ids.push(call_id_of(line, &tape));
                let mut item = LineTape { line, tape };
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
            call_ids
        });
        // A third thread hashes from the start: the walk and the build are each shorter than
        // the hashing of a large log, so hashing only when idle left it for the end.
        let hasher = scope.spawn(move || while hashing.help() {});
        let decoded = decode(LinesToDecode::Taped(feed));
        while hashing.help() {}
        hasher.join().expect("hashing thread");
        (walking.join().expect("walking thread"), decoded)
    });
    let hashed = digests.map(|_| hashing.collect());
    let records = check(source, &lines, digests.zip(hashed), call_ids)?;
    Ok((records, ranges, decoded))
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
        lines: first_records(source, lines, call_ids)?,
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
                    taped.line.to_vec()
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

    #[test]
    fn small_and_large_logs_hand_every_line_to_the_decoder() {
        for bytes in [10_000, 3 * PARALLEL_SCAN_BYTES] {
            let (log, digests) = log_of(bytes);
            let (records, ranges, seen) =
                decode_fetched(&log, Some(&digests), Path::new("x"), ranges_seen).unwrap();
            let expected: Vec<Vec<u8>> = complete_lines(&log, 0).map(|(_, l)| l.to_vec()).collect();
            assert_eq!(seen, expected);
            assert_eq!(records.lines, ranges);
            assert_eq!(ranges.len(), digests.len());
        }
    }

    #[test]
    fn refusals_name_the_source_and_offset() {
        for bytes in [10_000, 3 * PARALLEL_SCAN_BYTES] {
            let (log, mut digests) = log_of(bytes);
            let second = log.iter().position(|&b| b == b'\n').unwrap() + 1;
            let torn = &log[..log.len() - 1];
            let err = decode_fetched(torn, None, Path::new("src"), |_| ()).unwrap_err();
            assert!(err
                .to_string()
                .starts_with("src: the last line has no newline"));
            let err = decode_fetched(&log, Some(&digests[1..]), Path::new("src"), |_| ());
            assert!(err
                .unwrap_err()
                .to_string()
                .contains("payload digests were stored"));
            digests[1] = "0".repeat(64);
            let err = decode_fetched(&log, Some(&digests), Path::new("src"), |_| ()).unwrap_err();
            assert_eq!(
                err.to_string(),
                format!(
                    "src: the line does not match its payload digest {} (byte offset {second})",
                    digests[1]
                )
            );
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
