//! The stored form of one staged call: a *row* (the base columns, the digests and the
//! extras) and an *attachments blob*, both self-describing little-endian binary. Every
//! staging backend stores these bytes as they are (the file store in its segments, a database
//! in two binary columns), so encoding, decoding and verification live here once.
//!
//! Row (`ROW_MAGIC`, then in order):
//!
//! | field | encoding |
//! | --- | --- |
//! | versions | `u8` schema, `u8` digest, `u8` extras digest |
//! | rollout_id, model_call_id | `u32 len + UTF-8` |
//! | parent_call_id | `u8` 0 (absent) or 1 + text |
//! | mode | `u8` 0 text, 1 token_in |
//! | prev_len, delta_len, cum_len, weight_version | `u64` each |
//! | digest, extras_digest, chain_hash, cumulative_hash | 32 bytes each |
//! | n | `u64`, the delta length |
//! | token ids | `n x u64` |
//! | masks | `n x u8`: 0 is `0.0`, 1 is `1.0`, 2 is `-0.0` (NeMo Gym's digest tells them apart) |
//! | log-probabilities | `n x f64` (the caller's exact values; the digest hashes float32) |
//! | extras | `u8` 0 (None) or 1 + a map, typed: `N`, `B u8`, `I i64`, `F f64`, `S text`, `L u32 n + items`, `D u32 n + (text key + value)`, keys in the caller's order |
//!
//! Attachments blob: `u32 count`, then per attachment `text name`, `u8 kind` (0 bytes, 1 a
//! buffer-protocol export, 2 an Arrow array), `text format` (the buffer's struct format or the
//! Arrow format string, empty if unknown), `text dtype` (e.g. numpy's `<f4`, empty if
//! unknown), `u8` 0 or 1 + `u32 ndim + ndim x u64` (the shape), `u32 nbuffers` and per buffer
//! `u64 len + bytes` (one buffer for bytes and buffers; validity then values for Arrow).
//!
//! Both end in a 16-byte checksum (the first half of the SHA-256 of the bytes before it): the
//! staging digest covers log-probabilities only as float32 while the row keeps the caller's
//! f64, so the checksum is what protects their low bits. A row is verified by its checksum and
//! by recomputing its staging digest from the decoded columns (and, when the extras are read,
//! the extras digest): a damaged row cannot pass as a valid one.

use sha2::{Digest, Sha256};

use super::digest::{self, CallFields, CallHead, Digest32, DigestError, Extra, Mode, StagedFields};

const CHECK_LEN: usize = 16;

fn checksum(bytes: &[u8]) -> [u8; CHECK_LEN] {
    let full: [u8; 32] = Sha256::digest(bytes).into();
    full[..CHECK_LEN].try_into().expect("16")
}

fn seal(mut out: Vec<u8>) -> Vec<u8> {
    let check = checksum(&out);
    out.extend_from_slice(&check);
    out
}

/// A blob's body and its checksum, not compared.
fn split_sealed<'a>(blob: &'a [u8], what: &str) -> RowResult<(&'a [u8], &'a [u8])> {
    if blob.len() < CHECK_LEN {
        return bad(format!("{what} is shorter than its checksum"));
    }
    Ok(blob.split_at(blob.len() - CHECK_LEN))
}

/// The bytes before a blob's checksum, if the checksum matches.
fn unseal<'a>(blob: &'a [u8], what: &str) -> RowResult<&'a [u8]> {
    let (body, check) = split_sealed(blob, what)?;
    if checksum(body) != check {
        return bad(format!("{what} does not match its checksum"));
    }
    Ok(body)
}

/// First bytes of every row (the `1` is the row layout's version).
pub const ROW_MAGIC: &[u8; 4] = b"TCR1";
/// Deepest nesting of extras a row may hold (deeper trees are refused when staged). NeMo Gym's
/// recursive encoder reaches about 330 levels under Python's default recursion limit (1000), and
/// more under a raised one: every tree it can digest at a limit up to ~3000 is stageable here.
/// Staging a tree this deep takes under 1 MiB of stack (tested on a 1 MiB thread), less per
/// level than NeMo Gym's own encoder, which overflows a thread's stack sooner.
pub const MAX_EXTRAS_DEPTH: usize = 1024;

/// A decoding or verification failure; the caller names the row (key, file, offset).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct RowError(pub String);

type RowResult<T> = std::result::Result<T, RowError>;

fn bad<T>(what: impl Into<String>) -> RowResult<T> {
    Err(RowError(what.into()))
}

/// A staged call as a row holds it: the base columns, the call digest and the extras.
#[derive(Debug, Clone, PartialEq)]
pub struct StagedCall {
    pub fields: CallFields,
    pub digest: Digest32,
    pub extras: Option<Vec<(String, Extra)>>,
}

impl StagedCall {
    /// NeMo Gym's `staging_key(rollout_id, model_call_id)`.
    pub fn key(&self) -> String {
        staging_key(&self.fields.rollout_id, &self.fields.model_call_id)
    }

    /// Recompute every digest the record carries (the staging digest and the extras digest)
    /// and compare: what `stage` does before it writes anything.
    pub fn verify(&self) -> std::result::Result<(), DigestError> {
        let actual = digest::staging_digest(&self.fields)?;
        if actual != self.digest {
            return Err(DigestError::Value(
                "digest does not match staged call contents".into(),
            ));
        }
        let extras = digest::extras_digest(self.extras.as_deref())?;
        if extras != self.fields.extras_digest {
            return Err(DigestError::Value(
                "extras_digest does not match extras".into(),
            ));
        }
        Ok(())
    }
}

/// NeMo Gym's deterministic key: `"{rollout_id}/{model_call_id}"`.
pub fn staging_key(rollout_id: &str, model_call_id: &str) -> String {
    let mut key = String::with_capacity(rollout_id.len() + 1 + model_call_id.len());
    key.push_str(rollout_id);
    key.push('/');
    key.push_str(model_call_id);
    key
}

/// One attachment as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attachment {
    pub name: String,
    pub kind: AttachmentKind,
    pub format: String,
    pub dtype: String,
    pub shape: Option<Vec<u64>>,
    pub buffers: Vec<Vec<u8>>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttachmentKind {
    Bytes = 0,
    Buffer = 1,
    Arrow = 2,
}

impl AttachmentKind {
    pub fn as_str(self) -> &'static str {
        match self {
            AttachmentKind::Bytes => "bytes",
            AttachmentKind::Buffer => "buffer",
            AttachmentKind::Arrow => "arrow",
        }
    }
    fn from_u8(byte: u8) -> Option<Self> {
        match byte {
            0 => Some(AttachmentKind::Bytes),
            1 => Some(AttachmentKind::Buffer),
            2 => Some(AttachmentKind::Arrow),
            _ => None,
        }
    }
}

// ---- writing ---------------------------------------------------------------------------

struct Out(Vec<u8>);

impl Out {
    fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    fn u32(&mut self, v: usize) {
        self.0.extend_from_slice(&(v as u32).to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn text(&mut self, s: &str) {
        self.u32(s.len());
        self.0.extend_from_slice(s.as_bytes());
    }
    fn raw(&mut self, b: &[u8]) {
        self.0.extend_from_slice(b);
    }
    fn extra(&mut self, value: &Extra) {
        match value {
            Extra::Null => self.u8(b'N'),
            Extra::Bool(b) => {
                self.u8(b'B');
                self.u8(u8::from(*b));
            }
            Extra::Int(i) => {
                self.u8(b'I');
                self.raw(&i.to_le_bytes());
            }
            Extra::Float(f) => {
                self.u8(b'F');
                self.raw(&f.to_bits().to_le_bytes());
            }
            Extra::Str(s) => {
                self.u8(b'S');
                self.text(s);
            }
            Extra::List(items) => {
                self.u8(b'L');
                self.u32(items.len());
                items.iter().for_each(|item| self.extra(item));
            }
            Extra::Map(entries) => {
                self.u8(b'D');
                self.u32(entries.len());
                for (key, item) in entries {
                    self.text(key);
                    self.extra(item);
                }
            }
        }
    }
}

fn mask_code(mask: f64) -> u8 {
    if mask == 1.0 {
        1
    } else if mask.is_sign_negative() {
        2
    } else {
        0
    }
}

/// Encode a verified call as a row. Texts longer than `u32::MAX` bytes are refused by the
/// caller's size limits long before this.
pub fn encode_row(call: &StagedCall) -> Vec<u8> {
    let f = &call.fields;
    let n = f.token_ids.len();
    let mut out = Out(Vec::with_capacity(
        256 + f.rollout_id.len() + f.model_call_id.len() + n * 17,
    ));
    out.raw(ROW_MAGIC);
    out.u8(f.schema_version as u8);
    out.u8(f.digest_version as u8);
    out.u8(f.extras_digest_version as u8);
    out.text(&f.rollout_id);
    out.text(&f.model_call_id);
    match &f.parent_call_id {
        None => out.u8(0),
        Some(parent) => {
            out.u8(1);
            out.text(parent);
        }
    }
    out.u8(match f.mode {
        Mode::Text => 0,
        Mode::TokenIn => 1,
    });
    for v in [f.prev_len, f.delta_len, f.cum_len, f.weight_version] {
        out.u64(v);
    }
    out.raw(&call.digest);
    out.raw(&f.extras_digest);
    out.raw(&f.chain_hash);
    out.raw(&f.cumulative_hash);
    out.u64(n as u64);
    for id in &f.token_ids {
        out.u64(*id);
    }
    for m in &f.token_mask {
        out.u8(mask_code(*m));
    }
    for lp in &f.log_probs {
        out.raw(&lp.to_bits().to_le_bytes());
    }
    match &call.extras {
        None => out.u8(0),
        Some(entries) => {
            out.u8(1);
            out.extra(&Extra::Map(entries.clone()));
        }
    }
    seal(out.0)
}

/// SHA-256 of a stage's row and attachments blob: equal exactly when two stages of a key carry
/// the same content (what idempotency and conflict compare; a file frame keeps its first 16
/// bytes, the PostgreSQL backend all of it).
pub fn content_digest(row: &[u8], attachments: &[u8]) -> Digest32 {
    let mut hasher = Sha256::new();
    hasher.update(row);
    hasher.update(attachments);
    hasher.finalize().into()
}

impl Attachment {
    /// Whether this is plain bytes in another bytes-like type: a one-dimensional buffer of
    /// unsigned bytes (struct format `B`) with no dtype and one buffer of the shape's length
    /// (a `bytearray`, a `memoryview` of bytes, an `array('B')`). A numpy array carries its
    /// dtype and is not.
    fn is_plain_bytes(&self) -> bool {
        self.kind == AttachmentKind::Buffer
            && self.format == "B"
            && self.dtype.is_empty()
            && self.buffers.len() == 1
            && self.shape.as_deref() == Some(&[self.buffers[0].len() as u64][..])
    }

    /// The attachment as it is compared and given back: plain bytes in any bytes-like type
    /// (see `is_plain_bytes`) are [`AttachmentKind::Bytes`], with no format and no shape, as
    /// `bytes` are stored. Anything else as it is.
    pub fn canonical(self) -> Self {
        if !self.is_plain_bytes() {
            return self;
        }
        Attachment {
            kind: AttachmentKind::Bytes,
            format: String::new(),
            shape: None,
            ..self
        }
    }
}

/// Each attachment in its canonical form ([`Attachment::canonical`]).
pub fn canonical_attachments(list: Vec<Attachment>) -> Vec<Attachment> {
    list.into_iter().map(Attachment::canonical).collect()
}

/// The attachments as a call's content, which has no order: each in its canonical form,
/// sorted by name (a stable sort: attachments of one name, which only a broken mapping
/// yields, keep their order).
fn content_of(list: Vec<Attachment>) -> Vec<Attachment> {
    let mut list = canonical_attachments(list);
    list.sort_by(|a, b| a.name.cmp(&b.name));
    list
}

/// Whether two stages of a key, as stored (row and attachments blob each), carry the same
/// call: the same row bytes and the same attachments by name, each in its canonical form (the
/// attachments are a mapping: the order a blob lists them in, the mapping's order, is not
/// content), an empty attachments blob, an empty list (what an older build stored for
/// `attachments={}`) and no attachments being one. What idempotency falls back to when the
/// content digests differ: a restage of the same data with another bytes-like type or with
/// its attachments in another order, or against a row an older build encoded. A blob that
/// does not decode is not the same content. The stored bytes are never changed.
pub fn same_content(row_a: &[u8], att_a: &[u8], row_b: &[u8], att_b: &[u8]) -> bool {
    if row_a != row_b {
        return false;
    }
    if att_a == att_b {
        return true;
    }
    match (decode_attachments(att_a), decode_attachments(att_b)) {
        (Ok(a), Ok(b)) => content_of(a) == content_of(b),
        _ => false,
    }
}

/// Encode attachments (in the given order) as one blob.
pub fn encode_attachments(attachments: &[Attachment]) -> Vec<u8> {
    let size: usize = attachments
        .iter()
        .map(|a| 64 + a.name.len() + a.buffers.iter().map(Vec::len).sum::<usize>())
        .sum();
    let mut out = Out(Vec::with_capacity(4 + size));
    out.u32(attachments.len());
    for a in attachments {
        out.text(&a.name);
        out.u8(a.kind as u8);
        out.text(&a.format);
        out.text(&a.dtype);
        match &a.shape {
            None => out.u8(0),
            Some(shape) => {
                out.u8(1);
                out.u32(shape.len());
                shape.iter().for_each(|d| out.u64(*d));
            }
        }
        out.u32(a.buffers.len());
        for buffer in &a.buffers {
            out.u64(buffer.len() as u64);
            out.raw(buffer);
        }
    }
    seal(out.0)
}

// ---- reading ---------------------------------------------------------------------------

struct In<'a> {
    buf: &'a [u8],
    at: usize,
}

impl<'a> In<'a> {
    fn take(&mut self, n: usize) -> RowResult<&'a [u8]> {
        match self.at.checked_add(n) {
            Some(end) if end <= self.buf.len() => {
                let out = &self.buf[self.at..end];
                self.at = end;
                Ok(out)
            }
            _ => bad(format!("row ends early (needs {n} bytes at {})", self.at)),
        }
    }
    fn u8(&mut self) -> RowResult<u8> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> RowResult<usize> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes(b.try_into().expect("4 bytes")) as usize)
    }
    fn u64(&mut self) -> RowResult<u64> {
        let b = self.take(8)?;
        Ok(u64::from_le_bytes(b.try_into().expect("8 bytes")))
    }
    fn d32(&mut self) -> RowResult<Digest32> {
        self.d32_ref().copied()
    }
    fn d32_ref(&mut self) -> RowResult<&'a Digest32> {
        Ok(self.take(32)?.try_into().expect("32 bytes"))
    }
    fn text(&mut self) -> RowResult<String> {
        self.text_ref().map(str::to_owned)
    }
    fn text_ref(&mut self) -> RowResult<&'a str> {
        let len = self.u32()?;
        let bytes = self.take(len)?;
        match std::str::from_utf8(bytes) {
            Ok(s) => Ok(s),
            Err(_) => bad("a text field is not UTF-8"),
        }
    }
    fn count(&mut self, each: usize) -> RowResult<usize> {
        let n = self.u32()?;
        // Every element takes at least `each` bytes: a count the rest cannot hold is damage
        // (and must not size an allocation).
        if n.saturating_mul(each) > self.buf.len() - self.at {
            return bad(format!("a count of {n} exceeds the row"));
        }
        Ok(n)
    }
    fn extra(&mut self, depth: usize) -> RowResult<Extra> {
        if depth > MAX_EXTRAS_DEPTH {
            return bad("extras nest too deeply");
        }
        Ok(match self.u8()? {
            b'N' => Extra::Null,
            b'B' => match self.u8()? {
                0 => Extra::Bool(false),
                1 => Extra::Bool(true),
                other => return bad(format!("bad boolean byte {other}")),
            },
            b'I' => Extra::Int(i64::from_le_bytes(self.take(8)?.try_into().expect("8"))),
            b'F' => Extra::Float(f64::from_bits(u64::from_le_bytes(
                self.take(8)?.try_into().expect("8"),
            ))),
            b'S' => Extra::Str(self.text()?),
            b'L' => {
                let n = self.count(1)?;
                let mut items = Vec::with_capacity(n);
                for _ in 0..n {
                    items.push(self.extra(depth + 1)?);
                }
                Extra::List(items)
            }
            b'D' => Extra::Map(self.map(depth)?),
            other => return bad(format!("unknown extras tag {other}")),
        })
    }
    fn map(&mut self, depth: usize) -> RowResult<Vec<(String, Extra)>> {
        let n = self.count(5)?;
        let mut entries = Vec::with_capacity(n);
        for _ in 0..n {
            let key = self.text()?;
            entries.push((key, self.extra(depth + 1)?));
        }
        Ok(entries)
    }
}

/// Where a row's extras start, after its base columns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExtrasAt(usize);

/// A row's base columns where they lie in its bytes: borrowed, nothing copied, nothing
/// verified (the parse itself is bounds-checked: [`BaseView::parse`]).
#[derive(Debug, Clone, Copy)]
pub struct BaseView<'a> {
    /// The scalar fields and digests the staging digest reads (as [`CallFields`] gives them).
    pub head: CallHead<'a>,
    /// The staging digest the row was stored with.
    pub digest: Digest32,
    /// `n x u64` little-endian.
    ids: &'a [u8],
    /// `n` mask codes, each checked to be 0, 1 or 2.
    codes: &'a [u8],
    /// `n x f64` little-endian.
    log_probs: &'a [u8],
    /// Where the extras start.
    pub extras_at: ExtrasAt,
}

impl<'a> BaseView<'a> {
    /// Parse a row's body (the bytes before its checksum): bounded and panic-free on any
    /// bytes; the token count is checked against what is left before anything is sized by it.
    pub fn parse(row: &'a [u8]) -> RowResult<Self> {
        let mut r = In { buf: row, at: 0 };
        if r.take(4)? != ROW_MAGIC {
            return bad("not a staged-call row (bad magic)");
        }
        let schema_version = r.u8()?;
        let digest_version = r.u8()?;
        let extras_digest_version = r.u8()?;
        let rollout_id = r.text_ref()?;
        let model_call_id = r.text_ref()?;
        let parent_call_id = match r.u8()? {
            0 => None,
            1 => Some(r.text_ref()?),
            other => return bad(format!("bad parent flag {other}")),
        };
        let mode = match r.u8()? {
            0 => Mode::Text,
            1 => Mode::TokenIn,
            other => return bad(format!("bad mode byte {other}")),
        };
        let prev_len = r.u64()?;
        let delta_len = r.u64()?;
        let cum_len = r.u64()?;
        let weight_version = r.u64()?;
        let digest = r.d32()?;
        let extras_digest = r.d32_ref()?;
        let chain_hash = r.d32_ref()?;
        let cumulative_hash = r.d32_ref()?;
        let n = r.u64()?;
        let n = usize::try_from(n)
            .ok()
            .filter(|n| n.saturating_mul(17) <= row.len() - r.at);
        let Some(n) = n else {
            return bad("the token count exceeds the row");
        };
        let ids = r.take(8 * n)?;
        let codes = r.take(n)?;
        if let Some(other) = codes.iter().find(|code| **code > 2) {
            return bad(format!("bad mask code {other}"));
        }
        let log_probs = r.take(8 * n)?;
        Ok(BaseView {
            head: CallHead {
                schema_version: u64::from(schema_version),
                digest_version: u64::from(digest_version),
                extras_digest_version: u64::from(extras_digest_version),
                rollout_id,
                model_call_id,
                parent_call_id,
                mode,
                prev_len,
                delta_len,
                cum_len,
                weight_version,
                extras_digest,
                chain_hash,
                cumulative_hash,
            },
            digest,
            ids,
            codes,
            log_probs,
            extras_at: ExtrasAt(r.at),
        })
    }

    /// The token ids.
    pub fn token_ids(&self) -> impl ExactSizeIterator<Item = u64> + 'a {
        self.ids
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().expect("8")))
    }

    /// The masks (`0.0`, `1.0` or `-0.0`).
    pub fn token_mask(&self) -> impl ExactSizeIterator<Item = f64> + 'a {
        self.codes.iter().map(|code| match code {
            1 => 1.0,
            2 => -0.0,
            _ => 0.0,
        })
    }

    /// The log-probabilities, exactly as staged.
    pub fn log_probs(&self) -> impl ExactSizeIterator<Item = f64> + 'a {
        self.log_probs
            .chunks_exact(8)
            .map(|c| f64::from_bits(u64::from_le_bytes(c.try_into().expect("8"))))
    }

    /// The owned columns.
    pub fn fields(&self) -> CallFields {
        let head = &self.head;
        CallFields {
            schema_version: head.schema_version,
            digest_version: head.digest_version,
            extras_digest_version: head.extras_digest_version,
            rollout_id: head.rollout_id.to_owned(),
            model_call_id: head.model_call_id.to_owned(),
            parent_call_id: head.parent_call_id.map(str::to_owned),
            mode: head.mode,
            prev_len: head.prev_len,
            delta_len: head.delta_len,
            cum_len: head.cum_len,
            weight_version: head.weight_version,
            token_ids: self.token_ids().collect(),
            token_mask: self.token_mask().collect(),
            log_probs: self.log_probs().collect(),
            extras_digest: *head.extras_digest,
            chain_hash: *head.chain_hash,
            cumulative_hash: *head.cumulative_hash,
        }
    }
}

/// The staging digest reads a row's columns where they lie (no [`CallFields`] copy).
impl StagedFields for BaseView<'_> {
    fn head(&self) -> CallHead<'_> {
        self.head
    }
    fn token_ids(&self) -> impl ExactSizeIterator<Item = u64> + '_ {
        BaseView::token_ids(self)
    }
    fn token_mask(&self) -> impl ExactSizeIterator<Item = f64> + '_ {
        BaseView::token_mask(self)
    }
    fn log_probs(&self) -> impl ExactSizeIterator<Item = f64> + '_ {
        BaseView::log_probs(self)
    }
}

fn parse_extras(row: &[u8], at: ExtrasAt) -> RowResult<Option<Vec<(String, Extra)>>> {
    let mut r = In { buf: row, at: at.0 };
    let extras = match r.u8()? {
        0 => None,
        1 => match r.u8()? {
            b'D' => Some(r.map(0)?),
            other => return bad(format!("extras are not a map (tag {other})")),
        },
        other => return bad(format!("bad extras flag {other}")),
    };
    if r.at != row.len() {
        return bad(format!("{} bytes after the row's end", row.len() - r.at));
    }
    Ok(extras)
}

/// Check a row's staging digest against its columns, hashed where they lie.
fn verify_base(view: &BaseView<'_>) -> RowResult<()> {
    match digest::staging_digest(view) {
        Ok(actual) if actual == view.digest => Ok(()),
        Ok(_) => bad("the staged digest does not match the stored columns"),
        Err(err) => bad(format!(
            "the stored columns are not a valid staged call: {err}"
        )),
    }
}

/// Check decoded extras against the row's extras digest.
fn verify_extras(extras: Option<&[(String, Extra)]>, expected: &Digest32) -> RowResult<()> {
    match digest::extras_digest(extras) {
        Ok(actual) if actual == *expected => Ok(()),
        Ok(_) => bad("the stored extras do not match their extras_digest"),
        Err(err) => bad(format!("the stored extras cannot be digested: {err}")),
    }
}

/// Decode a whole row and verify both digests (the row's checksum is checked once).
pub fn decode_verified(row: &[u8]) -> RowResult<StagedCall> {
    let body = unseal(row, "the row")?;
    let view = BaseView::parse(body)?;
    verify_base(&view)?;
    let extras = parse_extras(body, view.extras_at)?;
    verify_extras(extras.as_deref(), view.head.extras_digest)?;
    Ok(StagedCall {
        fields: view.fields(),
        digest: view.digest,
        extras,
    })
}

/// Verify a stored row as a fetch of `key` must before anything read from it is returned:
/// its checksum, its staging digest (recomputed from the columns where they lie in the
/// bytes), with `with_extras` its extras (to their end) and their extras digest, and last
/// [`check_key`], that it is the row of `key`.
pub fn verify_stored(row: &[u8], key: &str, with_extras: bool) -> RowResult<()> {
    verify_body(unseal(row, "the row")?, key, with_extras)
}

/// [`verify_stored`] of a row whose own checksum the caller has matched over these same bytes
/// (the file store's fold hashes each frame body once for its content hash and the row's
/// checksum both): every other check of [`verify_stored`].
pub fn verify_stored_summed(row: &[u8], key: &str, with_extras: bool) -> RowResult<()> {
    verify_body(split_sealed(row, "the row")?.0, key, with_extras)
}

fn verify_body(body: &[u8], key: &str, with_extras: bool) -> RowResult<()> {
    let view = BaseView::parse(body)?;
    verify_base(&view)?;
    if with_extras {
        let extras = parse_extras(body, view.extras_at)?;
        verify_extras(extras.as_deref(), view.head.extras_digest)?;
    }
    check_key(view.head.rollout_id, view.head.model_call_id, key)
}

/// A row's base columns (and, with `with_extras`, its extras) *as they read, nothing
/// verified*: for building a result while the same bytes are verified ([`verify_stored`]),
/// which must succeed before anything built from them is returned.
#[allow(clippy::type_complexity)]
pub fn view_unverified(
    row: &[u8],
    with_extras: bool,
) -> RowResult<(BaseView<'_>, Option<Option<Vec<(String, Extra)>>>)> {
    let (body, _) = split_sealed(row, "the row")?;
    let view = BaseView::parse(body)?;
    let extras = if with_extras {
        Some(parse_extras(body, view.extras_at)?)
    } else {
        None
    };
    Ok((view, extras))
}

/// That a decoded row is the row of `key` (`"{rollout_id}/{model_call_id}"`): a fetch asks an
/// index for a key's row, and a row that verifies but is another key's must not pass.
pub fn check_key(rollout_id: &str, model_call_id: &str, key: &str) -> RowResult<()> {
    let stored = staging_key(rollout_id, model_call_id);
    if stored == key {
        Ok(())
    } else {
        bad(format!("the stored row is the row of {stored:?}"))
    }
}

/// Decode an attachments blob.
pub fn decode_attachments(blob: &[u8]) -> RowResult<Vec<Attachment>> {
    if blob.is_empty() {
        return Ok(Vec::new());
    }
    let blob = unseal(blob, "the attachments")?;
    let mut r = In { buf: blob, at: 0 };
    let n = r.count(14)?;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let name = r.text()?;
        let Some(kind) = AttachmentKind::from_u8(r.u8()?) else {
            return bad("unknown attachment kind");
        };
        let format = r.text()?;
        let dtype = r.text()?;
        let shape = match r.u8()? {
            0 => None,
            1 => {
                let ndim = r.count(8)?;
                Some(
                    (0..ndim)
                        .map(|_| r.u64())
                        .collect::<RowResult<Vec<u64>>>()?,
                )
            }
            other => return bad(format!("bad shape flag {other}")),
        };
        let nbuf = r.count(8)?;
        let mut buffers = Vec::with_capacity(nbuf);
        for _ in 0..nbuf {
            let len = usize::try_from(r.u64()?).map_err(|_| RowError("huge buffer".into()))?;
            buffers.push(r.take(len)?.to_vec());
        }
        out.push(Attachment {
            name,
            kind,
            format,
            dtype,
            shape,
            buffers,
        });
    }
    if r.at != blob.len() {
        return bad("bytes after the last attachment");
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::staging::digest::{chain_hash, hash_token_ids};

    pub(crate) fn sample(extras: Option<Vec<(String, Extra)>>) -> StagedCall {
        let token_ids = vec![1, 2, u64::MAX];
        let extras_digest = digest::extras_digest(extras.as_deref()).unwrap();
        let fields = CallFields {
            schema_version: 2,
            digest_version: 2,
            extras_digest_version: 1,
            rollout_id: "r/é".into(),
            model_call_id: "c".into(),
            parent_call_id: None,
            mode: Mode::Text,
            prev_len: 0,
            delta_len: 3,
            cum_len: 3,
            weight_version: 9,
            chain_hash: chain_hash(None, &token_ids),
            cumulative_hash: hash_token_ids(&token_ids),
            token_ids,
            token_mask: vec![-0.0, 1.0, 1.0],
            log_probs: vec![0.0, -0.1, -1e-300],
            extras_digest,
        };
        let digest = digest::staging_digest(&fields).unwrap();
        StagedCall {
            fields,
            digest,
            extras,
        }
    }

    #[test]
    fn a_row_round_trips_exactly_and_verifies() {
        let extras = vec![
            (
                "z".to_string(),
                Extra::List(vec![Extra::Null, Extra::Bool(true)]),
            ),
            (
                "a".to_string(),
                Extra::Map(vec![("k".into(), Extra::Float(0.5))]),
            ),
            ("m".to_string(), Extra::Str("ü".into())),
            ("i".to_string(), Extra::Int(i64::MIN)),
        ];
        for call in [sample(None), sample(Some(extras))] {
            call.verify().unwrap();
            let row = encode_row(&call);
            let back = decode_verified(&row).unwrap();
            assert_eq!(back, call);
            assert!(back.fields.token_mask[0].is_sign_negative());
        }
    }

    /// A deterministic stream of bits for varied rows.
    struct Bits(u64);

    impl Bits {
        fn next(&mut self) -> u64 {
            self.0 = self
                .0
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            self.0 >> 11
        }
    }

    /// Varied calls, valid and not: roots and children, every mask code (`-0.0` too), prompt
    /// carries with `0.0` and `-0.0` log-probs, log-probs that narrow to float32 zero or
    /// infinity, deltas that cross the framer's 4096-byte buffers, an empty delta, extras or
    /// none, and calls NeMo Gym refuses for each reason a row can carry.
    fn varied_calls() -> Vec<StagedCall> {
        let mut bits = Bits(7);
        let mut out = Vec::new();
        for (i, n) in [1usize, 2, 3, 511, 512, 513, 1023, 1024, 1025, 1500]
            .into_iter()
            .enumerate()
        {
            let child = i % 2 == 1;
            let token_ids: Vec<u64> = (0..n)
                .map(|k| match k % 5 {
                    0 => u64::MAX - bits.next() % 3,
                    1 => 0,
                    _ => bits.next() % 200_000,
                })
                .collect();
            let token_mask: Vec<f64> = (0..n)
                .map(|k| match (k + i) % 3 {
                    0 => 1.0,
                    1 => 0.0,
                    _ => -0.0,
                })
                .collect();
            let log_probs = token_mask
                .iter()
                .enumerate()
                .map(|(k, m)| match (*m == 1.0, k % 4) {
                    (false, 0) => -0.0,
                    (false, _) => 0.0,
                    (true, 0) => -1e-300, // float32 -0.0
                    (true, 1) => -3.0e38,
                    (true, 2) => -((bits.next() % 1_000_000) as f64) / 7919.0,
                    (true, _) => -50.0 * bits.next() as f64 / (1u64 << 53) as f64,
                })
                .collect();
            let extras = (i % 3 == 0).then(|| {
                vec![
                    (
                        "z".to_string(),
                        Extra::List(vec![Extra::Null, Extra::Int(-1)]),
                    ),
                    ("a".to_string(), Extra::Float(0.25)),
                ]
            });
            let fields = CallFields {
                schema_version: 2,
                digest_version: 2,
                extras_digest_version: 1,
                rollout_id: format!("rollout-{i}/é"),
                model_call_id: format!("call-{i}"),
                parent_call_id: child.then(|| format!("call-{}", i - 1)),
                mode: if child { Mode::TokenIn } else { Mode::Text },
                prev_len: if child { 100 * i as u64 } else { 0 },
                delta_len: n as u64,
                cum_len: if child { 100 * i as u64 } else { 0 } + n as u64,
                weight_version: bits.next(),
                extras_digest: digest::extras_digest(extras.as_deref()).unwrap(),
                chain_hash: chain_hash(None, &token_ids),
                cumulative_hash: hash_token_ids(&token_ids),
                token_ids,
                token_mask,
                log_probs,
            };
            out.push(StagedCall {
                digest: digest::staging_digest(&fields).unwrap(),
                fields,
                extras,
            });
        }
        let base = sample(None);
        let refused = |change: &dyn Fn(&mut CallFields)| {
            let mut call = base.clone();
            change(&mut call.fields);
            call
        };
        out.extend([
            refused(&|f| {
                f.token_ids.clear();
                f.token_mask.clear();
                f.log_probs.clear();
                f.delta_len = 0;
                f.cum_len = 0;
            }),
            refused(&|f| f.delta_len = 4),
            refused(&|f| f.cum_len = 4),
            refused(&|f| f.prev_len = u64::MAX),
            refused(&|f| f.schema_version = 1),
            refused(&|f| f.digest_version = 3),
            refused(&|f| f.extras_digest_version = 0),
            refused(&|f| f.model_call_id.clear()),
            refused(&|f| f.parent_call_id = Some(String::new())),
            refused(&|f| f.parent_call_id = Some("p".into())),
            refused(&|f| f.mode = Mode::TokenIn),
            refused(&|f| f.log_probs[0] = -0.5),
            refused(&|f| f.log_probs[1] = 1e300),
            refused(&|f| f.log_probs[2] = f64::NAN),
            refused(&|f| f.log_probs[2] = f64::NEG_INFINITY),
        ]);
        out
    }

    #[test]
    fn the_digest_of_a_row_read_in_place_is_the_digest_of_its_owned_columns() {
        let calls = varied_calls();
        let mut refusals = 0;
        for call in &calls {
            let row = encode_row(call);
            let (body, _) = split_sealed(&row, "the row").unwrap();
            let view = BaseView::parse(body).unwrap();
            let owned = digest::staging_digest(&call.fields);
            assert_eq!(
                digest::staging_digest(&view),
                owned,
                "{:?}",
                call.fields.rollout_id
            );
            match owned {
                Ok(d) => {
                    assert_eq!(d, call.digest);
                    verify_stored(&row, &call.key(), false).unwrap();
                    verify_stored(&row, &call.key(), true).unwrap();
                }
                Err(_) => {
                    refusals += 1;
                    assert!(verify_stored(&row, &call.key(), false).is_err());
                }
            }
        }
        assert_eq!(refusals, 15);
        // The view's digest is NeMo Gym's: the golden vector (staging/conformance/
        // golden_vectors.json), stored as a row and hashed where it lies.
        let row = encode_row(&StagedCall {
            fields: digest::golden_call(),
            digest: [0; 32],
            extras: None,
        });
        let (body, _) = split_sealed(&row, "the row").unwrap();
        assert_eq!(
            hex::encode(digest::staging_digest(&BaseView::parse(body).unwrap()).unwrap()),
            digest::GOLDEN_STAGING_DIGEST
        );
    }

    #[test]
    fn a_verified_row_of_another_key_is_refused() {
        let call = sample(None);
        let row = encode_row(&call);
        verify_stored(&row, "r/é/c", false).unwrap();
        let err = verify_stored(&row, "r/é/d", false).unwrap_err();
        assert_eq!(err.0, "the stored row is the row of \"r/é/c\"");
    }

    #[test]
    fn any_flipped_byte_is_caught() {
        let row = encode_row(&sample(Some(vec![("k".into(), Extra::Int(3))])));
        for at in 0..row.len() {
            let mut damaged = row.clone();
            damaged[at] ^= 0x40;
            assert!(
                decode_verified(&damaged).is_err(),
                "byte {at} flipped passed"
            );
        }
        assert!(decode_verified(&row[..row.len() - 1]).is_err());
    }

    #[test]
    fn attachments_round_trip() {
        let list = vec![
            Attachment {
                name: "pixels".into(),
                kind: AttachmentKind::Buffer,
                format: "<f".into(),
                dtype: "<f4".into(),
                shape: Some(vec![2, 1]),
                buffers: vec![vec![0, 0, 128, 63, 0, 0, 0, 64]],
            },
            Attachment {
                name: "raw".into(),
                kind: AttachmentKind::Bytes,
                format: String::new(),
                dtype: String::new(),
                shape: None,
                buffers: vec![Vec::new()],
            },
        ];
        let blob = encode_attachments(&list);
        assert_eq!(decode_attachments(&blob).unwrap(), list);
        assert_eq!(
            decode_attachments(&encode_attachments(&[])).unwrap(),
            vec![]
        );
        assert!(decode_attachments(&blob[..blob.len() - 1]).is_err());
    }

    fn plain(
        kind: AttachmentKind,
        format: &str,
        dtype: &str,
        shape: Option<Vec<u64>>,
    ) -> Attachment {
        Attachment {
            name: "a".into(),
            kind,
            format: format.into(),
            dtype: dtype.into(),
            shape,
            buffers: vec![b"abc".to_vec()],
        }
    }

    #[test]
    fn same_content_of_bytes_like_and_empty_attachments() {
        let row = b"row".to_vec();
        let bytes = encode_attachments(&[plain(AttachmentKind::Bytes, "", "", None)]);
        let bytearray =
            encode_attachments(&[plain(AttachmentKind::Buffer, "B", "", Some(vec![3]))]);
        assert_ne!(bytes, bytearray);
        assert!(same_content(&row, &bytes, &row, &bytearray));
        assert!(!same_content(&row, &bytes, b"other", &bytearray));
        // A numpy array carries its dtype; a 2-d or signed buffer is not plain bytes.
        for other in [
            plain(AttachmentKind::Buffer, "B", "|u1", Some(vec![3])),
            plain(AttachmentKind::Buffer, "B", "", Some(vec![1, 3])),
            plain(AttachmentKind::Buffer, "b", "", Some(vec![3])),
        ] {
            assert!(!same_content(
                &row,
                &bytes,
                &row,
                &encode_attachments(&[other])
            ));
        }
        // An older build's `{}` (an empty list, sealed) is no attachments.
        let old_empty = encode_attachments(&[]);
        assert_eq!(old_empty.len(), 20);
        assert!(same_content(&row, &old_empty, &row, &[]));
        assert!(!same_content(&row, &old_empty, &row, &bytes));
        assert!(!same_content(&row, &old_empty[..19], &row, &[]));
    }

    fn named(name: &str, data: &[u8]) -> Attachment {
        Attachment {
            name: name.into(),
            buffers: vec![data.to_vec()],
            ..plain(AttachmentKind::Bytes, "", "", None)
        }
    }

    #[test]
    fn same_content_whatever_the_order_of_the_attachments() {
        let row = b"row".to_vec();
        let (p, m) = (named("pixels", b"P"), named("mask", b"M"));
        let first = encode_attachments(&[p.clone(), m.clone()]);
        let second = encode_attachments(&[m.clone(), p.clone()]);
        assert_ne!(first, second);
        assert!(same_content(&row, &first, &row, &second));
        // With a bytes-like type changed as well.
        let bytearray = Attachment {
            kind: AttachmentKind::Buffer,
            format: "B".into(),
            shape: Some(vec![1]),
            ..m.clone()
        };
        let third = encode_attachments(&[bytearray, p.clone()]);
        assert!(same_content(&row, &first, &row, &third));
        // Other data under a name, a missing or an extra attachment: not the same.
        let other = encode_attachments(&[named("mask", b"P"), named("pixels", b"M")]);
        assert!(!same_content(&row, &first, &row, &other));
        assert!(!same_content(
            &row,
            &first,
            &row,
            &encode_attachments(std::slice::from_ref(&p))
        ));
        let extra = encode_attachments(&[m, p, named("z", b"")]);
        assert!(!same_content(&row, &first, &row, &extra));
    }
}
