//! The two SHA-256 digests of the format.
//!
//! * The token digest frames a token-id sequence as
//!   `b"nemo-gym-tokens" + [1] + u64_be(len) + u64_be(id)...`; the empty sequence hashes the
//!   domain alone (no version byte, no length). Lineage verification compares these.
//! * The payload digest is the SHA-256 of an entry's canonical line (without its newline); two
//!   puts of one call id carry "the same payload" exactly when these are equal.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

use sha2::{Digest, Sha256};

const TOKEN_DOMAIN: &[u8] = b"nemo-gym-tokens";
const TOKEN_FRAMING_VERSION: u8 = 1;

/// Lowercase hex SHA-256 of arbitrary bytes.
pub fn sha256_hex(data: &[u8]) -> String {
    hex::encode(Sha256::digest(data))
}

/// The payload digest of one canonical line (no trailing newline).
pub fn payload_digest(line: &[u8]) -> String {
    sha256_hex(line)
}

/// The payload digests of two lines, hashed together (`crate::sha256x2`: the two messages'
/// rounds interleaved, ~1.4x the throughput of one after the other).
pub fn payload_digest_pair(a: &[u8], b: &[u8]) -> (String, String) {
    let (a, b) = crate::sha256x2::digest_pair(a, b);
    (hex::encode(a), hex::encode(b))
}

/// The token digest of a sequence of ids, lowercase hex.
pub fn token_digest(ids: &[u64]) -> String {
    let mut hasher = Sha256::new();
    hasher.update(TOKEN_DOMAIN);
    if !ids.is_empty() {
        hasher.update([TOKEN_FRAMING_VERSION]);
        hasher.update((ids.len() as u64).to_be_bytes());
        // Feed big-endian ids through a stack buffer: one update per 512 ids, no allocation.
        let mut buf = [0u8; 4096];
        for chunk in ids.chunks(buf.len() / 8) {
            for (slot, id) in buf.chunks_exact_mut(8).zip(chunk) {
                slot.copy_from_slice(&id.to_be_bytes());
            }
            hasher.update(&buf[..chunk.len() * 8]);
        }
    }
    hex::encode(hasher.finalize())
}

/// The payload digests of `lines`, in order, hashed two at a time ([`payload_digest_pair`]).
pub fn payload_digests<'b>(lines: impl IntoIterator<Item = &'b [u8]>) -> Vec<String> {
    let mut lines = lines.into_iter();
    let mut digests = Vec::with_capacity(lines.size_hint().0);
    while let Some(a) = lines.next() {
        match lines.next() {
            Some(b) => {
                let (a, b) = payload_digest_pair(a, b);
                digests.extend([a, b]);
            }
            None => digests.push(payload_digest(a)),
        }
    }
    digests
}

/// The payload digests of a batch of lines, hashed by whichever threads call [`help`]: a
/// thread that would otherwise wait for another to finish hashes the next unclaimed line
/// instead, so the hashing spreads over the threads that are idle.
///
/// [`help`]: SharedDigests::help
#[derive(Debug)]
pub struct SharedDigests<'b> {
    lines: Vec<&'b [u8]>,
    next: AtomicUsize,
    digests: Vec<OnceLock<String>>,
}

impl<'b> SharedDigests<'b> {
    pub fn new(lines: Vec<&'b [u8]>) -> Self {
        let digests = lines.iter().map(|_| OnceLock::new()).collect();
        SharedDigests {
            lines,
            next: AtomicUsize::new(0),
            digests,
        }
    }

    /// Hash the next two lines no thread has claimed (together: `payload_digest_pair`); false
    /// once every line is claimed.
    pub fn help(&self) -> bool {
        let index = self.next.fetch_add(2, Ordering::Relaxed);
        match (self.lines.get(index), self.lines.get(index + 1)) {
            (Some(a), Some(b)) => {
                let (da, db) = payload_digest_pair(a, b);
                self.digests[index].get_or_init(|| da);
                self.digests[index + 1].get_or_init(|| db);
                true
            }
            (Some(line), None) => {
                self.digests[index].get_or_init(|| payload_digest(line));
                true
            }
            _ => false,
        }
    }

    /// Every digest in line order. Hashes what is unclaimed and waits for lines other threads
    /// are hashing; a line whose hashing thread died is hashed here (never a missing digest).
    pub fn collect(&self) -> Vec<String> {
        while self.help() {}
        self.digests
            .iter()
            .zip(&self.lines)
            .map(|(digest, line)| digest.get_or_init(|| payload_digest(line)).clone())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reference_token_digest(ids: &[u64]) -> String {
        // The framing written out the slow, obvious way.
        let mut bytes = TOKEN_DOMAIN.to_vec();
        if !ids.is_empty() {
            bytes.push(1);
            bytes.extend((ids.len() as u64).to_be_bytes());
            for id in ids {
                bytes.extend(id.to_be_bytes());
            }
        }
        sha256_hex(&bytes)
    }

    #[test]
    fn empty_sequence_hashes_the_domain_only() {
        assert_eq!(token_digest(&[]), sha256_hex(b"nemo-gym-tokens"));
    }

    #[test]
    fn chunked_hashing_matches_the_plain_framing() {
        for len in [1usize, 2, 511, 512, 513, 1024, 5000] {
            let ids: Vec<u64> = (0..len as u64).map(|i| i * 2654435761 % 200_003).collect();
            assert_eq!(
                token_digest(&ids),
                reference_token_digest(&ids),
                "len {len}"
            );
        }
        assert_eq!(
            token_digest(&[u64::MAX]),
            reference_token_digest(&[u64::MAX])
        );
    }

    #[test]
    fn shared_digests_are_each_lines_payload_digest_whoever_hashes_it() {
        let owned: Vec<Vec<u8>> = (0..200)
            .map(|i| {
                format!("{{\"model_call_id\":\"c{i}\"}}")
                    .repeat(i % 7 + 1)
                    .into_bytes()
            })
            .collect();
        let lines: Vec<&[u8]> = owned.iter().map(Vec::as_slice).collect();
        let expected: Vec<String> = lines.iter().map(|line| payload_digest(line)).collect();
        let shared = SharedDigests::new(lines.clone());
        let collected = std::thread::scope(|scope| {
            let helpers: Vec<_> = (0..3)
                .map(|_| scope.spawn(|| while shared.help() {}))
                .collect();
            let collected = shared.collect();
            helpers.into_iter().for_each(|h| h.join().unwrap());
            collected
        });
        assert_eq!(collected, expected);
        // Nobody helping: collect hashes everything itself.
        assert_eq!(SharedDigests::new(lines).collect(), expected);
        assert!(SharedDigests::new(Vec::new()).collect().is_empty());
    }

    #[test]
    fn golden_vectors_from_the_reference() {
        // From shared/golden/token_digests.json.
        assert_eq!(
            token_digest(&[]),
            "2e222d36d0c6ae1db1ec18b3f96d9a46df5db61b40137bbfbac4cdf0acde9763"
        );
        assert_eq!(
            token_digest(&[0]),
            "0596efeb21b51ec6eb122c9e470703df19a095a7c5ccb96bf87df0ba2447ba59"
        );
        assert_eq!(
            token_digest(&[1, 2, 3]),
            "bf99633051449f0f3248b4995a7c8468b9561d7732447341916085f12ff9ff54"
        );
    }
}
