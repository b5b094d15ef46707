//! NeMo Gym 0.7.0's staging digests (`token_id_capture/staging/digest.py`), byte for byte.
//!
//! Every value is framed by type and length: texts and byte strings as `u64_be(len) + bytes`,
//! unsigned integers as `u64_be`, token ids as `u64_be(count) + u64_be(id)...`, masks and
//! log-probabilities as IEEE-754 float32 big-endian bit patterns behind a `u64_be(count)`, and
//! each digest has its own domain-separation prefix:
//!
//! | digest | input |
//! | --- | --- |
//! | prefix (cumulative) hash | `b"nemo-gym-staging-prefix-v2" + tokens(ids)` |
//! | chain hash | `b"nemo-gym-staging-chain-v1" + (0x00 | 0x01 + parent[32]) + tokens(delta)` |
//! | extras digest | `b"nemo-gym-staging-extras-v1" + [1] + extra(value)` |
//! | staging (call) digest | `b"nemo-gym-staging-call-v2" + versions + fields` (see [`staging_digest`]) |
//!
//! Extras are a typed tree (`N`, `B`, `I` i64, `F` f64, `S` text, `L` list, `D` map with keys
//! sorted by their UTF-8 bytes). The checks a caller's values need before they can be hashed
//! (finite floats, masks of 0.0 or 1.0, lengths) are [`check_call`]'s, in NeMo Gym's order and
//! words, so a record that NeMo Gym refuses is refused here with the same reason.

use sha2::{Digest, Sha256};

pub const STAGING_SCHEMA_VERSION: u64 = 2;
pub const STAGING_DIGEST_VERSION: u64 = 2;
pub const EXTRAS_DIGEST_VERSION: u64 = 1;

const CALL_DOMAIN: &[u8] = b"nemo-gym-staging-call-v2";
const EXTRAS_DOMAIN: &[u8] = b"nemo-gym-staging-extras-v1";
const PREFIX_DOMAIN: &[u8] = b"nemo-gym-staging-prefix-v2";
const CHAIN_DOMAIN: &[u8] = b"nemo-gym-staging-chain-v1";

/// A SHA-256 digest.
pub type Digest32 = [u8; 32];

/// One value of a staged call's extras (NeMo Gym's JSON-like envelope). Maps keep the order
/// the caller gave (what the stored row gives back); the digest sorts their keys.
#[derive(Debug, Clone, PartialEq)]
pub enum Extra {
    Null,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
    List(Vec<Extra>),
    Map(Vec<(String, Extra)>),
}

/// Why a value cannot be digested: NeMo Gym raises `ValueError` or `TypeError` for these.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DigestError {
    #[error("{0}")]
    Value(String),
    #[error("{0}")]
    Type(String),
}

pub type DigestResult<T> = std::result::Result<T, DigestError>;

fn value_err<T>(message: impl Into<String>) -> DigestResult<T> {
    Err(DigestError::Value(message.into()))
}

/// Streams the framed encoding into a hasher (nothing is buffered).
struct Framer(Sha256);

impl Framer {
    fn new(domain: &[u8]) -> Self {
        let mut hasher = Sha256::new();
        hasher.update(domain);
        Framer(hasher)
    }
    fn raw(&mut self, bytes: &[u8]) {
        self.0.update(bytes);
    }
    fn u64(&mut self, value: u64) {
        self.0.update(value.to_be_bytes());
    }
    fn text(&mut self, value: &str) {
        self.u64(value.len() as u64);
        self.0.update(value.as_bytes());
    }
    /// `u64_be(count)` and each id, big-endian (hashed a buffer at a time).
    fn tokens(&mut self, mut ids: impl ExactSizeIterator<Item = u64>) {
        self.u64(ids.len() as u64);
        let mut buf = [0u8; 4096];
        loop {
            let mut used = 0;
            // `zip` takes a slot before an id: an id is never taken without a slot for it.
            for (slot, id) in buf.chunks_exact_mut(8).zip(ids.by_ref()) {
                slot.copy_from_slice(&id.to_be_bytes());
                used += 8;
            }
            if used == 0 {
                return;
            }
            self.0.update(&buf[..used]);
        }
    }
    /// `u64_be(count)` and each value's float32 pattern, big-endian, with NeMo Gym's refusals
    /// ([`float32_refusal`]; the first value refused stops it: nothing is finished).
    fn float32s(
        &mut self,
        mut values: impl ExactSizeIterator<Item = f64>,
        field: &str,
    ) -> DigestResult<()> {
        self.u64(values.len() as u64);
        let mut buf = [0u8; 4096];
        loop {
            let mut used = 0;
            for (slot, value) in buf.chunks_exact_mut(4).zip(values.by_ref()) {
                // Finite after narrowing is exactly a finite value float32 can hold (NaN and
                // infinities stay so, and a finite value out of range rounds to infinity).
                let narrowed = value as f32;
                if !narrowed.is_finite() {
                    return Err(float32_refusal(value, field));
                }
                slot.copy_from_slice(&narrowed.to_bits().to_be_bytes());
                used += 4;
            }
            if used == 0 {
                return Ok(());
            }
            self.0.update(&buf[..used]);
        }
    }
    fn finish(self) -> Digest32 {
        self.0.finalize().into()
    }
}

/// `hash_token_ids`: the digest of one exact cumulative token prefix.
pub fn hash_token_ids(ids: &[u64]) -> Digest32 {
    let mut framer = Framer::new(PREFIX_DOMAIN);
    framer.tokens(ids.iter().copied());
    framer.finish()
}

/// `encode_token_ids`: the framing itself (count, then each id, big-endian u64).
pub fn encode_token_ids(ids: &[u64]) -> Vec<u8> {
    let mut out = Vec::with_capacity(8 + 8 * ids.len());
    out.extend_from_slice(&(ids.len() as u64).to_be_bytes());
    for id in ids {
        out.extend_from_slice(&id.to_be_bytes());
    }
    out
}

/// `compute_chain_hash`: this delta chained onto its parent's chain hash (`None` for a root).
pub fn chain_hash(parent: Option<&Digest32>, delta: &[u64]) -> Digest32 {
    let mut framer = Framer::new(CHAIN_DOMAIN);
    match parent {
        None => framer.raw(&[0]),
        Some(parent) => {
            framer.raw(&[1]);
            framer.raw(parent);
        }
    }
    framer.tokens(delta.iter().copied());
    framer.finish()
}

/// The chain hash of a whole chain of deltas, root first.
pub fn chain_hash_of<'a>(deltas: impl IntoIterator<Item = &'a [u64]>) -> Option<Digest32> {
    let mut running = None;
    for delta in deltas {
        running = Some(chain_hash(running.as_ref(), delta));
    }
    running
}

/// Check an extras tree the way NeMo Gym's encoder does (finite floats; i64 is guaranteed by
/// the type) without hashing it.
pub fn check_extra(value: &Extra) -> DigestResult<()> {
    match value {
        Extra::Float(f) if !f.is_finite() => value_err(format!(
            "extras floats must be finite, got {}",
            py_float_repr(*f)
        )),
        Extra::List(items) => items.iter().try_for_each(check_extra),
        Extra::Map(entries) => entries.iter().try_for_each(|(_, v)| check_extra(v)),
        _ => Ok(()),
    }
}

fn frame_extra(framer: &mut Framer, value: &Extra) -> DigestResult<()> {
    match value {
        Extra::Null => framer.raw(b"N"),
        Extra::Bool(b) => framer.raw(if *b { b"B\x01" } else { b"B\x00" }),
        Extra::Int(i) => {
            framer.raw(b"I");
            framer.raw(&i.to_be_bytes());
        }
        Extra::Float(f) => {
            if !f.is_finite() {
                return value_err(format!(
                    "extras floats must be finite, got {}",
                    py_float_repr(*f)
                ));
            }
            framer.raw(b"F");
            framer.raw(&f.to_be_bytes());
        }
        Extra::Str(s) => {
            framer.raw(b"S");
            framer.text(s);
        }
        Extra::List(items) => {
            framer.raw(b"L");
            framer.u64(items.len() as u64);
            for item in items {
                frame_extra(framer, item)?;
            }
        }
        Extra::Map(entries) => frame_map(framer, entries)?,
    }
    Ok(())
}

fn frame_map(framer: &mut Framer, entries: &[(String, Extra)]) -> DigestResult<()> {
    let mut sorted: Vec<&(String, Extra)> = entries.iter().collect();
    // Python's sort is stable; duplicate keys cannot occur in a dict, but a decoded row could
    // carry them, and then the first-seen order is kept like a stable sort.
    sorted.sort_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
    framer.raw(b"D");
    framer.u64(sorted.len() as u64);
    for (key, item) in sorted {
        framer.text(key);
        frame_extra(framer, item)?;
    }
    Ok(())
}

/// `compute_extras_digest`: `extras` is `None` or a map.
pub fn extras_digest(extras: Option<&[(String, Extra)]>) -> DigestResult<Digest32> {
    let mut framer = Framer::new(EXTRAS_DOMAIN);
    framer.raw(&[EXTRAS_DIGEST_VERSION as u8]);
    match extras {
        None => framer.raw(b"N"),
        Some(entries) => frame_map(&mut framer, entries)?,
    }
    Ok(framer.finish())
}

/// `EMPTY_EXTRAS_DIGEST`, the extras digest of `None`.
pub fn empty_extras_digest() -> Digest32 {
    extras_digest(None).expect("None always digests")
}

/// Capture mode of a staged call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Text,
    TokenIn,
}

impl Mode {
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Text => "text",
            Mode::TokenIn => "token_in",
        }
    }
    pub fn parse(text: &str) -> Option<Mode> {
        match text {
            "text" => Some(Mode::Text),
            "token_in" => Some(Mode::TokenIn),
            _ => None,
        }
    }
}

/// The base columns of one staged call (NeMo Gym's `StagedCallBaseSnapshot` without its
/// `digest`), as the digest covers them. Masks and log-probabilities keep the caller's f64
/// values (the digest hashes their float32 patterns; the row stores them exactly).
#[derive(Debug, Clone, PartialEq)]
pub struct CallFields {
    pub schema_version: u64,
    pub digest_version: u64,
    pub extras_digest_version: u64,
    pub rollout_id: String,
    pub model_call_id: String,
    pub parent_call_id: Option<String>,
    pub mode: Mode,
    pub prev_len: u64,
    pub delta_len: u64,
    pub cum_len: u64,
    pub weight_version: u64,
    pub token_ids: Vec<u64>,
    pub token_mask: Vec<f64>,
    pub log_probs: Vec<f64>,
    pub extras_digest: Digest32,
    pub chain_hash: Digest32,
    pub cumulative_hash: Digest32,
}

/// The scalar fields and digests of one staged call, borrowed (see [`StagedFields`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CallHead<'a> {
    pub schema_version: u64,
    pub digest_version: u64,
    pub extras_digest_version: u64,
    pub rollout_id: &'a str,
    pub model_call_id: &'a str,
    pub parent_call_id: Option<&'a str>,
    pub mode: Mode,
    pub prev_len: u64,
    pub delta_len: u64,
    pub cum_len: u64,
    pub weight_version: u64,
    pub extras_digest: &'a Digest32,
    pub chain_hash: &'a Digest32,
    pub cumulative_hash: &'a Digest32,
}

/// The base columns of one staged call wherever they are held: [`CallFields`] (owned), or a
/// stored row read in place (`row::BaseView`), so [`check_call`] and [`staging_digest`] read
/// either without copying it into the other.
pub trait StagedFields {
    /// The scalar fields and digests.
    fn head(&self) -> CallHead<'_>;
    /// The token ids of the delta.
    fn token_ids(&self) -> impl ExactSizeIterator<Item = u64> + '_;
    /// The masks, as the caller's f64 values.
    fn token_mask(&self) -> impl ExactSizeIterator<Item = f64> + '_;
    /// The log-probabilities, as the caller's f64 values.
    fn log_probs(&self) -> impl ExactSizeIterator<Item = f64> + '_;
}

impl StagedFields for CallFields {
    fn head(&self) -> CallHead<'_> {
        CallHead {
            schema_version: self.schema_version,
            digest_version: self.digest_version,
            extras_digest_version: self.extras_digest_version,
            rollout_id: &self.rollout_id,
            model_call_id: &self.model_call_id,
            parent_call_id: self.parent_call_id.as_deref(),
            mode: self.mode,
            prev_len: self.prev_len,
            delta_len: self.delta_len,
            cum_len: self.cum_len,
            weight_version: self.weight_version,
            extras_digest: &self.extras_digest,
            chain_hash: &self.chain_hash,
            cumulative_hash: &self.cumulative_hash,
        }
    }
    fn token_ids(&self) -> impl ExactSizeIterator<Item = u64> + '_ {
        self.token_ids.iter().copied()
    }
    fn token_mask(&self) -> impl ExactSizeIterator<Item = f64> + '_ {
        self.token_mask.iter().copied()
    }
    fn log_probs(&self) -> impl ExactSizeIterator<Item = f64> + '_ {
        self.log_probs.iter().copied()
    }
}

/// Python's `repr` of a float, for messages (`nan`, `inf`, `-inf`, `1e+300`, `0.5`).
pub fn py_float_repr(value: f64) -> String {
    if value.is_nan() {
        return "nan".into();
    }
    if value.is_infinite() {
        return if value > 0.0 { "inf" } else { "-inf" }.into();
    }
    if value == value.trunc() && value.abs() < 1e16 {
        return format!("{value:.1}");
    }
    // Shortest round-trip digits; Python switches to exponent notation outside 1e-4..1e16.
    let abs = value.abs();
    if (1e-4..1e16).contains(&abs) {
        format!("{value}")
    } else {
        let s = format!("{value:e}");
        // Rust writes `1e300` / `1.5e-7`; Python writes `1e+300` / `1.5e-07`.
        match s.split_once('e') {
            Some((mantissa, exp)) => {
                let (sign, digits) = match exp.strip_prefix('-') {
                    Some(d) => ('-', d),
                    None => ('+', exp),
                };
                format!("{mantissa}e{sign}{digits:0>2}")
            }
            None => s,
        }
    }
}

/// Why a mask or log-probability has no float32 pattern (`value as f32` is not finite), in
/// NeMo Gym's words: the value itself is not finite, or it is beyond float32's range.
#[cold]
fn float32_refusal(value: f64, field: &str) -> DigestError {
    DigestError::Value(if value.is_finite() {
        format!(
            "{field} value cannot be represented as float32: {}",
            py_float_repr(value)
        )
    } else {
        format!(
            "{field} values must be finite Python floats, got {}",
            py_float_repr(value)
        )
    })
}

/// The semantic checks of `compute_staging_digest` that typed fields can still fail, in NeMo
/// Gym's order and words (the versions, non-empty identifiers, root/child shape, lengths, masks,
/// prompt-carry log-probabilities, `cum_len`, finiteness).
pub fn check_call(call: &impl StagedFields) -> DigestResult<()> {
    let head = call.head();
    if head.schema_version != STAGING_SCHEMA_VERSION {
        return value_err(format!(
            "unsupported staging schema version {}",
            head.schema_version
        ));
    }
    if head.digest_version != STAGING_DIGEST_VERSION {
        return value_err(format!(
            "unsupported staging digest version {}",
            head.digest_version
        ));
    }
    if head.extras_digest_version != EXTRAS_DIGEST_VERSION {
        return value_err(format!(
            "unsupported extras digest version {}",
            head.extras_digest_version
        ));
    }
    if head.rollout_id.is_empty() || head.model_call_id.is_empty() {
        return value_err("rollout_id and model_call_id must be non-empty");
    }
    if head.parent_call_id == Some("") {
        return value_err("parent_call_id must be non-empty when present");
    }
    match head.parent_call_id {
        None if head.prev_len != 0 || head.mode != Mode::Text => {
            return value_err("a parentless call must be a text-mode root with prev_len == 0");
        }
        Some(_) if head.prev_len == 0 || head.mode != Mode::TokenIn => {
            return value_err("a child call must use token_in mode with prev_len > 0");
        }
        _ => {}
    }
    if head.delta_len == 0 {
        return value_err("a staged call delta must contain at least one token");
    }
    let ids = call.token_ids().len();
    if head.delta_len != ids as u64 {
        return value_err(format!(
            "delta_len {} does not match {ids} token IDs",
            head.delta_len
        ));
    }
    if ids != call.token_mask().len() || call.token_mask().len() != call.log_probs().len() {
        return value_err("token IDs, masks, and log probabilities must have equal lengths");
    }
    if call.token_mask().any(|m| m != 0.0 && m != 1.0) {
        return value_err("token_mask_delta must contain only 0.0 or 1.0");
    }
    if call
        .token_mask()
        .zip(call.log_probs())
        .any(|(m, lp)| m == 0.0 && lp != 0.0)
    {
        return value_err("prompt-carry log probabilities must be 0.0");
    }
    let expected = head.prev_len.checked_add(head.delta_len);
    if expected != Some(head.cum_len) {
        return value_err(format!(
            "cum_len {} does not equal prev_len + delta_len ({})",
            head.cum_len,
            u128::from(head.prev_len) + u128::from(head.delta_len)
        ));
    }
    Ok(())
}

/// `compute_staging_digest` of checked fields (run [`check_call`] first; the float32
/// narrowing refusals are raised here, as NeMo Gym raises them while encoding). The fields
/// are read where they are held ([`StagedFields`]): a stored row is hashed in place.
pub fn staging_digest(call: &impl StagedFields) -> DigestResult<Digest32> {
    check_call(call)?;
    let head = call.head();
    // Masks and log-probabilities are narrowed while they are hashed: every mask (and its
    // refusal) comes before any log-probability, as NeMo Gym encodes them.
    let mut framer = Framer::new(CALL_DOMAIN);
    framer.raw(&[
        head.schema_version as u8,
        head.digest_version as u8,
        head.extras_digest_version as u8,
    ]);
    framer.text(head.rollout_id);
    framer.text(head.model_call_id);
    match head.parent_call_id {
        None => framer.raw(&[0]),
        Some(parent) => {
            framer.raw(&[1]);
            framer.text(parent);
        }
    }
    framer.text(head.mode.as_str());
    framer.u64(head.prev_len);
    framer.u64(head.delta_len);
    framer.u64(head.cum_len);
    framer.u64(head.weight_version);
    // Each column is itself length-framed: u64(len(encoded)) + encoded.
    let ids = call.token_ids();
    framer.u64(8 + 8 * ids.len() as u64);
    framer.tokens(ids);
    let masks = call.token_mask();
    framer.u64(8 + 4 * masks.len() as u64);
    framer.float32s(masks, "token_mask_delta")?;
    let log_probs = call.log_probs();
    framer.u64(8 + 4 * log_probs.len() as u64);
    framer.float32s(log_probs, "generation_log_probs_delta")?;
    framer.raw(head.extras_digest);
    framer.raw(&[1]);
    framer.raw(head.chain_hash);
    framer.raw(&[1]);
    framer.raw(head.cumulative_hash);
    Ok(framer.finish())
}

/// Parse a lowercase SHA-256 hex digest (NeMo Gym refuses uppercase).
pub fn parse_digest(text: &str) -> Option<Digest32> {
    if text.len() != 64 || !text.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
        return None;
    }
    let mut out = [0u8; 32];
    hex::decode_to_slice(text, &mut out).ok()?;
    Some(out)
}

/// NeMo Gym 0.7.0's golden staged call (`staging/conformance/golden_vectors.json`), for the
/// tests of every module that hashes one.
#[cfg(test)]
pub(crate) fn golden_call() -> CallFields {
    CallFields {
        schema_version: 2,
        digest_version: 2,
        extras_digest_version: 1,
        rollout_id: "rollout-1".into(),
        model_call_id: "call-1".into(),
        parent_call_id: Some("parent-1".into()),
        mode: Mode::TokenIn,
        prev_len: 3,
        delta_len: 2,
        cum_len: 5,
        weight_version: 7,
        token_ids: vec![10, 11],
        token_mask: vec![0.0, 1.0],
        log_probs: vec![0.0, -0.25],
        extras_digest: parse_digest(
            "032024e899456be6e9a78c6d0399c5112d2ca7fa18d4ea9cf0d8cb7d0094f3a3",
        )
        .unwrap(),
        chain_hash: [0x11; 32],
        cumulative_hash: [0x22; 32],
    }
}

/// The staging digest NeMo Gym's golden vectors give [`golden_call`].
#[cfg(test)]
pub(crate) const GOLDEN_STAGING_DIGEST: &str =
    "1122c7fe7e914c809eb9b1c09b26d94a50c1eb2790e7430fbcd8363b846ccf27";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn golden_vectors() {
        let pair =
            |a: i64, b: i64| Extra::List(vec![Extra::List(vec![Extra::Int(a), Extra::Int(b)])]);
        let extras = vec![(
            "routed_experts".to_string(),
            Extra::List(vec![pair(1, 2), pair(3, 4)]),
        )];
        assert_eq!(
            hex::encode(extras_digest(Some(&extras)).unwrap()),
            "032024e899456be6e9a78c6d0399c5112d2ca7fa18d4ea9cf0d8cb7d0094f3a3"
        );
        assert_eq!(
            hex::encode(staging_digest(&golden_call()).unwrap()),
            GOLDEN_STAGING_DIGEST
        );
    }

    #[test]
    fn refusals_use_nemo_words() {
        let mut call = golden_call();
        call.token_mask[1] = 0.5;
        assert_eq!(
            staging_digest(&call).unwrap_err().to_string(),
            "token_mask_delta must contain only 0.0 or 1.0"
        );
        let mut call = golden_call();
        call.log_probs[1] = 1e300;
        assert_eq!(
            staging_digest(&call).unwrap_err().to_string(),
            "generation_log_probs_delta value cannot be represented as float32: 1e+300"
        );
        let mut call = golden_call();
        call.log_probs[1] = f64::NAN;
        assert_eq!(
            staging_digest(&call).unwrap_err().to_string(),
            "generation_log_probs_delta values must be finite Python floats, got nan"
        );
    }

    #[test]
    fn chain_and_prefix_hashes_differ_by_domain_and_marker() {
        let root = chain_hash(None, &[10, 11, 12]);
        assert_ne!(root, hash_token_ids(&[10, 11, 12]));
        assert_ne!(chain_hash(Some(&root), &[1]), chain_hash(None, &[1]));
        assert_eq!(chain_hash_of([&[10u64, 11, 12][..]]), Some(root));
    }

    #[test]
    fn float_reprs_follow_python() {
        assert_eq!(py_float_repr(1e300), "1e+300");
        assert_eq!(py_float_repr(-0.25), "-0.25");
        assert_eq!(py_float_repr(3.0), "3.0");
        assert_eq!(py_float_repr(1.5e-7), "1.5e-07");
        assert_eq!(py_float_repr(f64::NEG_INFINITY), "-inf");
    }
}
