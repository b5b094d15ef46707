//! Staging (`rust/src/staging/`): NeMo Gym's staging digests with its Python semantics (the
//! same checks, in the same order, raising the same `ValueError`/`TypeError` words), the row
//! codec every staging backend shares, and the file staging store (`StagingFileStore`,
//! wrapped by `tokencapture.staging.FileStagingStore`).
//!
//! Arguments are read from Python objects with the GIL held; hashing, encoding, the commit
//! (write and fdatasync) and reads run detached.

use std::path::PathBuf;
use std::sync::Arc;

use pyo3::exceptions::{PyOSError, PyRecursionError, PyTypeError, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBool, PyBytes, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};

use super::errors::{to_pyerr, ExceptionClass};
use crate::fork::PerProcess;
use crate::split::Split;
use crate::staging::digest::{
    self, CallFields, Digest32, DigestError, Extra, Mode, EXTRAS_DIGEST_VERSION,
    STAGING_DIGEST_VERSION, STAGING_SCHEMA_VERSION,
};
use crate::staging::file::{FetchOutcome, FileStaging, Frame};
use crate::staging::row::{self, Attachment, AttachmentKind, BaseView, StagedCall};
use crate::staging::StagingError;

static RETIRED: ExceptionClass = ExceptionClass::new("TokenCaptureRetiredError");
static CONFLICT: ExceptionClass = ExceptionClass::new("TokenCaptureConflictError");
static CORRUPT: ExceptionClass = ExceptionClass::new("TokenCaptureCorruptionError");
static UNKNOWN_KEY: ExceptionClass =
    ExceptionClass::in_module("tokencapture.staging.errors", "StagingKeyError");
static RETIRED_KEY: ExceptionClass =
    ExceptionClass::in_module("tokencapture.staging.errors", "StagingKeyRetiredError");

pub(super) fn staging_err(py: Python<'_>, err: StagingError) -> PyErr {
    let message = err.to_string();
    match err {
        StagingError::Digest(DigestError::Type(m)) => PyTypeError::new_err(m),
        StagingError::Digest(DigestError::Value(m)) => PyValueError::new_err(m),
        StagingError::Invalid(m) => PyValueError::new_err(m),
        StagingError::Retired(_) => RETIRED.err(py, message),
        StagingError::Conflict(_) => CONFLICT.err(py, message),
        StagingError::UnknownKey(_) => UNKNOWN_KEY.err(py, message),
        StagingError::RetiredKey { .. } => RETIRED_KEY.err(py, message),
        StagingError::Io(err) => to_pyerr(py, err),
        StagingError::Corrupt(err) => CORRUPT.err(py, err.to_string()),
        StagingError::Failed(m) => PyOSError::new_err(m),
    }
}

fn digest_err(err: DigestError) -> PyErr {
    match err {
        DigestError::Type(m) => PyTypeError::new_err(m),
        DigestError::Value(m) => PyValueError::new_err(m),
    }
}

fn value_err<T>(message: String) -> PyResult<T> {
    Err(PyValueError::new_err(message))
}

fn repr(value: &Bound<'_, PyAny>) -> String {
    value
        .repr()
        .map(|r| r.to_string())
        .unwrap_or_else(|_| "<unrepresentable>".into())
}

fn show(value: &Bound<'_, PyAny>) -> String {
    value
        .str()
        .map(|r| r.to_string())
        .unwrap_or_else(|_| "<unprintable>".into())
}

fn type_name(value: &Bound<'_, PyAny>) -> String {
    value
        .get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "?".into())
}

/// A Python str as UTF-8; a lone surrogate raises Python's own `UnicodeEncodeError` (what
/// NeMo Gym's `value.encode("utf-8")` raises).
fn utf8(value: &Bound<'_, PyString>) -> PyResult<String> {
    match value.to_str() {
        Ok(s) => Ok(s.to_owned()),
        Err(_) => {
            value.call_method1("encode", ("utf-8",))?;
            Err(PyValueError::new_err("text is not valid UTF-8"))
        }
    }
}

/// NeMo Gym's `_encode_text`: a str (subclasses too), else `TypeError`.
fn text_field(value: &Bound<'_, PyAny>) -> PyResult<String> {
    match value.cast::<PyString>() {
        Ok(s) => utf8(s),
        Err(_) => Err(PyTypeError::new_err(format!(
            "expected text, got {}",
            type_name(value)
        ))),
    }
}

/// NeMo Gym's `_encode_uint`: an exact int in `0..=2**64-1`.
fn uint_field(value: &Bound<'_, PyAny>, field: &str) -> PyResult<u64> {
    if value.is_exact_instance_of::<PyInt>() {
        if let Ok(v) = value.extract::<u64>() {
            return Ok(v);
        }
    }
    value_err(format!(
        "{field} must be an unsigned 64-bit integer, got {}",
        repr(value)
    ))
}

/// NeMo Gym's `encode_token_ids` rules: every id an exact int in `0..=2**64-1`.
pub(super) fn token_id_list(value: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
    let one = |item: Bound<'_, PyAny>| uint_field(&item, "token_id");
    if let Ok(list) = value.cast::<PyList>() {
        return list.iter().map(one).collect();
    }
    if let Ok(tuple) = value.cast::<PyTuple>() {
        return tuple.iter().map(one).collect();
    }
    // `len()` first, as NeMo Gym's encoder takes it before iterating.
    value.len()?;
    value.try_iter()?.map(|item| one(item?)).collect()
}

/// NeMo Gym's `_encode_float32_values` rules for one value: an exact, finite float whose
/// float32 rounding is finite.
fn float32_value(value: &Bound<'_, PyAny>, field: &str) -> PyResult<f64> {
    let finite = if value.is_exact_instance_of::<PyFloat>() {
        let v: f64 = value.extract()?;
        v.is_finite().then_some(v)
    } else {
        None
    };
    let Some(v) = finite else {
        return value_err(format!(
            "{field} values must be finite Python floats, got {}",
            repr(value)
        ));
    };
    if (v as f32).is_infinite() {
        return value_err(format!(
            "{field} value cannot be represented as float32: {}",
            repr(value)
        ));
    }
    Ok(v)
}

fn items<'py>(value: &Bound<'py, PyAny>) -> PyResult<Vec<Bound<'py, PyAny>>> {
    if let Ok(list) = value.cast::<PyList>() {
        return Ok(list.iter().collect());
    }
    value.try_iter()?.collect()
}

/// NeMo Gym's `_validate_digest`.
fn checked_digest(value: &Bound<'_, PyAny>, field: &str) -> PyResult<Digest32> {
    value
        .cast::<PyString>()
        .ok()
        .and_then(|s| s.to_str().ok())
        .and_then(digest::parse_digest)
        .ok_or_else(|| {
            PyValueError::new_err(format!("{field} must be a lowercase SHA-256 hex digest"))
        })
}

/// NeMo Gym's `_encode_present_digest`: a str (else `TypeError`), then a valid digest.
fn present_digest(value: &Bound<'_, PyAny>, field: &str) -> PyResult<Digest32> {
    if !value.is_instance_of::<PyString>() {
        return Err(PyTypeError::new_err(format!(
            "{field} must be a digest string"
        )));
    }
    checked_digest(value, field)
}

fn is_float_value(value: &Bound<'_, PyAny>, target: f64) -> PyResult<bool> {
    if value.is_exact_instance_of::<PyFloat>() {
        return Ok(value.extract::<f64>()? == target);
    }
    value.eq(target)
}

fn version(value: &Bound<'_, PyAny>, expected: u64, what: &str) -> PyResult<u64> {
    if value.is_exact_instance_of::<PyInt>() && value.eq(expected)? {
        return Ok(expected);
    }
    value_err(format!("unsupported {what} version {}", show(value)))
}

/// One field of a record handed to `stage`. Something that is not a staged record (`None`, a
/// dict, a model built without its fields) is refused with a `TypeError` naming its type, which
/// the stores answer as `StageResult(ok=False)`, not with the `AttributeError` of the first
/// missing field.
fn record_field<'py>(record: &Bound<'py, PyAny>, name: &str) -> PyResult<Bound<'py, PyAny>> {
    record.getattr(name).map_err(|error| {
        if error.is_instance_of::<pyo3::exceptions::PyAttributeError>(record.py()) {
            PyTypeError::new_err(format!(
                "a staged record must be a StagedCallRecord (NeMo Gym's or tokencapture's), \
                 not a {} without {name}",
                type_name(record)
            ))
        } else {
            error
        }
    })
}

/// The arguments of `compute_staging_digest`, as Python objects.
pub(super) struct CallArgs<'py> {
    pub schema_version: Bound<'py, PyAny>,
    pub digest_version: Bound<'py, PyAny>,
    pub extras_digest_version: Bound<'py, PyAny>,
    pub rollout_id: Bound<'py, PyAny>,
    pub model_call_id: Bound<'py, PyAny>,
    pub parent_call_id: Bound<'py, PyAny>,
    pub mode: Bound<'py, PyAny>,
    pub prev_len: Bound<'py, PyAny>,
    pub delta_len: Bound<'py, PyAny>,
    pub cum_len: Bound<'py, PyAny>,
    pub weight_version: Bound<'py, PyAny>,
    pub token_ids_delta: Bound<'py, PyAny>,
    pub token_mask_delta: Bound<'py, PyAny>,
    pub generation_log_probs_delta: Bound<'py, PyAny>,
    pub extras_digest: Bound<'py, PyAny>,
    pub chain_hash: Bound<'py, PyAny>,
    pub cumulative_hash: Bound<'py, PyAny>,
}

impl<'py> CallArgs<'py> {
    /// Read the fields of a staged record (NeMo Gym's model or ours, or any object with them).
    fn of_record(record: &Bound<'py, PyAny>) -> PyResult<Self> {
        let get = |name: &str| record_field(record, name);
        Ok(CallArgs {
            schema_version: get("schema_version")?,
            digest_version: get("digest_version")?,
            extras_digest_version: get("extras_digest_version")?,
            rollout_id: get("rollout_id")?,
            model_call_id: get("model_call_id")?,
            parent_call_id: get("parent_call_id")?,
            mode: get("mode")?,
            prev_len: get("prev_len")?,
            delta_len: get("delta_len")?,
            cum_len: get("cum_len")?,
            weight_version: get("weight_version")?,
            token_ids_delta: get("token_ids_delta")?,
            token_mask_delta: get("token_mask_delta")?,
            generation_log_probs_delta: get("generation_log_probs_delta")?,
            extras_digest: get("extras_digest")?,
            chain_hash: get("chain_hash")?,
            cumulative_hash: get("cumulative_hash")?,
        })
    }

    /// `compute_staging_digest`'s checks in its order, then the typed fields.
    fn fields(&self) -> PyResult<CallFields> {
        let schema_version = version(
            &self.schema_version,
            STAGING_SCHEMA_VERSION,
            "staging schema",
        )?;
        let digest_version = version(
            &self.digest_version,
            STAGING_DIGEST_VERSION,
            "staging digest",
        )?;
        let extras_digest_version = version(
            &self.extras_digest_version,
            EXTRAS_DIGEST_VERSION,
            "extras digest",
        )?;
        if !self.rollout_id.is_truthy()? || !self.model_call_id.is_truthy()? {
            return value_err("rollout_id and model_call_id must be non-empty".into());
        }
        let parent_none = self.parent_call_id.is_none();
        if !parent_none && self.parent_call_id.eq("")? {
            return value_err("parent_call_id must be non-empty when present".into());
        }
        let is_text = self.mode.eq("text")?;
        let is_token_in = self.mode.eq("token_in")?;
        if !is_text && !is_token_in {
            return value_err(format!("unsupported capture mode {}", repr(&self.mode)));
        }
        if parent_none && (self.prev_len.ne(0)? || !is_text) {
            return value_err(
                "a parentless call must be a text-mode root with prev_len == 0".into(),
            );
        }
        if !parent_none && (self.prev_len.eq(0)? || !is_token_in) {
            return value_err("a child call must use token_in mode with prev_len > 0".into());
        }
        if self.delta_len.eq(0)? {
            return value_err("a staged call delta must contain at least one token".into());
        }
        let n_ids = self.token_ids_delta.len()?;
        if self.delta_len.ne(n_ids)? {
            return value_err(format!(
                "delta_len {} does not match {n_ids} token IDs",
                show(&self.delta_len)
            ));
        }
        let n_masks = self.token_mask_delta.len()?;
        let n_lps = self.generation_log_probs_delta.len()?;
        if n_ids != n_masks || n_masks != n_lps {
            return value_err(
                "token IDs, masks, and log probabilities must have equal lengths".into(),
            );
        }
        let masks = items(&self.token_mask_delta)?;
        for mask in &masks {
            if !is_float_value(mask, 0.0)? && !is_float_value(mask, 1.0)? {
                return value_err("token_mask_delta must contain only 0.0 or 1.0".into());
            }
        }
        let log_probs = items(&self.generation_log_probs_delta)?;
        for (mask, lp) in masks.iter().zip(&log_probs) {
            if is_float_value(mask, 0.0)? && !is_float_value(lp, 0.0)? {
                return value_err("prompt-carry log probabilities must be 0.0".into());
            }
        }
        let total = self.prev_len.add(&self.delta_len)?;
        if self.cum_len.ne(&total)? {
            return value_err(format!(
                "cum_len {} does not equal prev_len + delta_len ({})",
                show(&self.cum_len),
                show(&total)
            ));
        }
        let extras_digest = checked_digest(&self.extras_digest, "extras_digest")?;
        // The encoding, in its order.
        let rollout_id = text_field(&self.rollout_id)?;
        let model_call_id = text_field(&self.model_call_id)?;
        let parent_call_id = if parent_none {
            None
        } else {
            Some(text_field(&self.parent_call_id)?)
        };
        let mode_text = text_field(&self.mode)?;
        let mode =
            Mode::parse(&mode_text).unwrap_or(if is_text { Mode::Text } else { Mode::TokenIn });
        let prev_len = uint_field(&self.prev_len, "prev_len")?;
        let delta_len = uint_field(&self.delta_len, "delta_len")?;
        let cum_len = uint_field(&self.cum_len, "cum_len")?;
        let weight_version = uint_field(&self.weight_version, "weight_version")?;
        let token_ids = token_id_list(&self.token_ids_delta)?;
        let token_mask = masks
            .iter()
            .map(|m| float32_value(m, "token_mask_delta"))
            .collect::<PyResult<Vec<f64>>>()?;
        let log_probs = log_probs
            .iter()
            .map(|v| float32_value(v, "generation_log_probs_delta"))
            .collect::<PyResult<Vec<f64>>>()?;
        let chain_hash = present_digest(&self.chain_hash, "chain_hash")?;
        let cumulative_hash = present_digest(&self.cumulative_hash, "cumulative_hash")?;
        Ok(CallFields {
            schema_version,
            digest_version,
            extras_digest_version,
            rollout_id,
            model_call_id,
            parent_call_id,
            mode,
            prev_len,
            delta_len,
            cum_len,
            weight_version,
            token_ids,
            token_mask,
            log_probs,
            extras_digest,
            chain_hash,
            cumulative_hash,
        })
    }
}

static MAPPING: PyOnceLock<Py<PyAny>> = PyOnceLock::new();

fn is_mapping(value: &Bound<'_, PyAny>) -> PyResult<bool> {
    let py = value.py();
    let mapping = MAPPING.get_or_try_init(py, || -> PyResult<Py<PyAny>> {
        Ok(py.import("collections.abc")?.getattr("Mapping")?.unbind())
    })?;
    value.is_instance(mapping.bind(py))
}

/// NeMo Gym's `compute_extras_digest` argument rule, then the tree (`None` for `None`).
pub(super) fn extras_of(value: &Bound<'_, PyAny>) -> PyResult<Option<Vec<(String, Extra)>>> {
    if value.is_none() {
        return Ok(None);
    }
    // NeMo Gym copies any mapping with `dict(extras)`; only an exact dict is hashed as it is (a
    // subclass, `OrderedDict` say, is a mapping at the top, though not as a nested value).
    let dict = if value.is_exact_instance_of::<PyDict>() {
        value.cast::<PyDict>()?.clone()
    } else if is_mapping(value)? {
        let dict = PyDict::new(value.py());
        dict.update(value.cast()?)?;
        dict
    } else {
        return Err(PyTypeError::new_err(format!(
            "extras must be a mapping or None, got {}",
            type_name(value)
        )));
    };
    match extra_of(dict.as_any(), 0)? {
        Extra::Map(entries) => Ok(Some(entries)),
        _ => unreachable!("a dict converts to a map"),
    }
}

/// NeMo Gym's `_encode_extra` rules, checked in its order (a dict's values in sorted key
/// order); maps keep their insertion order in the tree.
fn extra_of(value: &Bound<'_, PyAny>, depth: usize) -> PyResult<Extra> {
    if depth > row::MAX_EXTRAS_DEPTH {
        return Err(PyRecursionError::new_err(
            "extras nest too deeply to be staged",
        ));
    }
    if value.is_none() {
        return Ok(Extra::Null);
    }
    if value.is_exact_instance_of::<PyBool>() {
        return Ok(Extra::Bool(value.extract()?));
    }
    if value.is_exact_instance_of::<PyInt>() {
        return match value.extract::<i64>() {
            Ok(i) => Ok(Extra::Int(i)),
            Err(_) => value_err(format!(
                "extras integer is outside signed 64-bit range: {}",
                show(value)
            )),
        };
    }
    if value.is_exact_instance_of::<PyFloat>() {
        let f: f64 = value.extract()?;
        if !f.is_finite() {
            return value_err(format!("extras floats must be finite, got {}", repr(value)));
        }
        return Ok(Extra::Float(f));
    }
    if value.is_exact_instance_of::<PyString>() {
        return Ok(Extra::Str(utf8(value.cast()?)?));
    }
    if value.is_exact_instance_of::<PyList>() {
        let list = value.cast::<PyList>()?;
        return list
            .iter()
            .map(|item| extra_of(&item, depth + 1))
            .collect::<PyResult<Vec<_>>>()
            .map(Extra::List);
    }
    if value.is_exact_instance_of::<PyDict>() {
        let dict = value.cast::<PyDict>()?;
        let pairs: Vec<(Bound<'_, PyAny>, Bound<'_, PyAny>)> = dict.iter().collect();
        if pairs
            .iter()
            .any(|(k, _)| !k.is_exact_instance_of::<PyString>())
        {
            return Err(PyTypeError::new_err(
                "extras mappings must have string keys",
            ));
        }
        let keys = pairs
            .iter()
            .map(|(k, _)| utf8(k.cast()?))
            .collect::<PyResult<Vec<String>>>()?;
        let mut order: Vec<usize> = (0..keys.len()).collect();
        order.sort_by(|a, b| keys[*a].as_bytes().cmp(keys[*b].as_bytes()));
        let mut converted: Vec<Option<Extra>> = vec![None; keys.len()];
        for i in order {
            converted[i] = Some(extra_of(&pairs[i].1, depth + 1)?);
        }
        return Ok(Extra::Map(
            keys.into_iter()
                .zip(converted)
                .map(|(k, v)| (k, v.expect("every value converted")))
                .collect(),
        ));
    }
    Err(PyTypeError::new_err(format!(
        "extras contain unsupported value type {}",
        type_name(value)
    )))
}

fn extra_to_py<'py>(py: Python<'py>, value: &Extra) -> PyResult<Bound<'py, PyAny>> {
    Ok(match value {
        Extra::Null => py.None().into_bound(py),
        Extra::Bool(b) => PyBool::new(py, *b).to_owned().into_any(),
        Extra::Int(i) => i.into_pyobject(py)?.into_any(),
        Extra::Float(f) => PyFloat::new(py, *f).into_any(),
        Extra::Str(s) => PyString::new(py, s).into_any(),
        Extra::List(items) => {
            let list = PyList::empty(py);
            for item in items {
                list.append(extra_to_py(py, item)?)?;
            }
            list.into_any()
        }
        Extra::Map(entries) => map_to_py(py, entries)?.into_any(),
    })
}

fn map_to_py<'py>(py: Python<'py>, entries: &[(String, Extra)]) -> PyResult<Bound<'py, PyDict>> {
    let dict = PyDict::new(py);
    for (k, v) in entries {
        dict.set_item(k, extra_to_py(py, v)?)?;
    }
    Ok(dict)
}

// ---- the digest functions ----------------------------------------------------------------

/// `hash_token_ids(token_ids)`: lowercase hex.
#[pyfunction]
fn staging_hash_token_ids(py: Python<'_>, token_ids: &Bound<'_, PyAny>) -> PyResult<String> {
    token_ids.len()?;
    let ids = token_id_list(token_ids)?;
    Ok(py.detach(|| hex::encode(digest::hash_token_ids(&ids))))
}

/// `encode_token_ids(token_ids)`: the framing bytes.
#[pyfunction]
fn staging_encode_token_ids<'py>(
    py: Python<'py>,
    token_ids: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyBytes>> {
    token_ids.len()?;
    let ids = token_id_list(token_ids)?;
    Ok(PyBytes::new(py, &digest::encode_token_ids(&ids)))
}

/// `compute_chain_hash(parent_chain_hash, token_ids_delta)`.
#[pyfunction]
fn staging_chain_hash(
    py: Python<'_>,
    parent_chain_hash: &Bound<'_, PyAny>,
    token_ids_delta: &Bound<'_, PyAny>,
) -> PyResult<String> {
    let parent = if parent_chain_hash.is_none() {
        None
    } else {
        Some(checked_digest(parent_chain_hash, "parent_chain_hash")?)
    };
    token_ids_delta.len()?;
    let ids = token_id_list(token_ids_delta)?;
    Ok(py.detach(|| hex::encode(digest::chain_hash(parent.as_ref(), &ids))))
}

/// `compute_extras_digest(extras)`.
#[pyfunction]
fn staging_extras_digest(py: Python<'_>, extras: &Bound<'_, PyAny>) -> PyResult<String> {
    let tree = extras_of(extras)?;
    py.detach(|| digest::extras_digest(tree.as_deref()))
        .map(hex::encode)
        .map_err(digest_err)
}

/// `compute_staging_digest(**fields)`.
#[pyfunction]
#[pyo3(signature = (
    *, schema_version, digest_version, extras_digest_version, rollout_id, model_call_id,
    parent_call_id, mode, prev_len, delta_len, cum_len, weight_version, token_ids_delta,
    token_mask_delta, generation_log_probs_delta, extras_digest, chain_hash, cumulative_hash
))]
#[allow(clippy::too_many_arguments)]
fn staging_digest<'py>(
    py: Python<'py>,
    schema_version: Bound<'py, PyAny>,
    digest_version: Bound<'py, PyAny>,
    extras_digest_version: Bound<'py, PyAny>,
    rollout_id: Bound<'py, PyAny>,
    model_call_id: Bound<'py, PyAny>,
    parent_call_id: Bound<'py, PyAny>,
    mode: Bound<'py, PyAny>,
    prev_len: Bound<'py, PyAny>,
    delta_len: Bound<'py, PyAny>,
    cum_len: Bound<'py, PyAny>,
    weight_version: Bound<'py, PyAny>,
    token_ids_delta: Bound<'py, PyAny>,
    token_mask_delta: Bound<'py, PyAny>,
    generation_log_probs_delta: Bound<'py, PyAny>,
    extras_digest: Bound<'py, PyAny>,
    chain_hash: Bound<'py, PyAny>,
    cumulative_hash: Bound<'py, PyAny>,
) -> PyResult<String> {
    let args = CallArgs {
        schema_version,
        digest_version,
        extras_digest_version,
        rollout_id,
        model_call_id,
        parent_call_id,
        mode,
        prev_len,
        delta_len,
        cum_len,
        weight_version,
        token_ids_delta,
        token_mask_delta,
        generation_log_probs_delta,
        extras_digest,
        chain_hash,
        cumulative_hash,
    };
    let fields = args.fields()?;
    py.detach(|| digest::staging_digest(&fields))
        .map(hex::encode)
        .map_err(digest_err)
}

// ---- records and rows --------------------------------------------------------------------

/// A staged record read from Python and checked: its fields, its claimed digest and extras.
pub(super) fn call_of_record(record: &Bound<'_, PyAny>) -> PyResult<StagedCall> {
    let fields = CallArgs::of_record(record)?.fields()?;
    let digest_value = record_field(record, "digest")?;
    let claimed = checked_digest(&digest_value, "digest")?;
    let extras = match record.getattr("extras") {
        Ok(extras) => extras_of(&extras)?,
        // A base snapshot has no extras: it must then claim the empty extras digest.
        Err(_) => None,
    };
    Ok(StagedCall {
        fields,
        digest: claimed,
        extras,
    })
}

/// Attachments prepared by `tokencapture.staging.attachments.encode_attachments`:
/// `(name, kind, format, dtype, shape or None, [buffers])` tuples.
/// One attachment as Python hands it over: (name, kind, format, dtype, shape, buffers).
type AttachmentTuple<'py> = (
    String,
    u8,
    String,
    String,
    Option<Vec<u64>>,
    Vec<Bound<'py, PyAny>>,
);

pub(super) fn attachments_of(value: &Bound<'_, PyAny>) -> PyResult<Option<Vec<Attachment>>> {
    if value.is_none() {
        return Ok(None);
    }
    let mut out = Vec::new();
    for item in value.try_iter()? {
        let item = item?;
        let (name, kind, format, dtype, shape, buffers): AttachmentTuple<'_> = item.extract()?;
        let kind = match kind {
            0 => AttachmentKind::Bytes,
            1 => AttachmentKind::Buffer,
            2 => AttachmentKind::Arrow,
            other => return value_err(format!("unknown attachment kind {other}")),
        };
        let buffers = buffers
            .iter()
            .map(|b| -> PyResult<Vec<u8>> {
                if let Ok(bytes) = b.cast::<PyBytes>() {
                    return Ok(bytes.as_bytes().to_vec());
                }
                let buffer = pyo3::buffer::PyBuffer::<u8>::get(b)?;
                buffer.to_vec(b.py())
            })
            .collect::<PyResult<Vec<_>>>()?;
        out.push(Attachment {
            name,
            kind,
            format,
            dtype,
            shape,
            buffers,
        });
    }
    Ok(Some(out))
}

/// Verify a decoded-from-Python call the way `stage` must: every digest recomputed.
pub(super) fn verified(call: &StagedCall) -> Result<(), StagingError> {
    call.verify().map_err(StagingError::Digest)
}

/// A verified, encoded staged call: what every staging backend writes.
#[pyclass(frozen, name = "StagedRow", module = "tokencapture._core")]
pub(super) struct StagedRow {
    #[pyo3(get)]
    key: String,
    #[pyo3(get)]
    rollout_id: String,
    #[pyo3(get)]
    model_call_id: String,
    row: Vec<u8>,
    attachments: Vec<u8>,
    has_attachments: bool,
    /// Lowercase hex SHA-256 of row and attachments, computed with them (see `content_digest`).
    content_digest: String,
}

#[pymethods]
impl StagedRow {
    /// The row bytes (`rust/src/staging/row.rs`).
    #[getter]
    fn row<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.row)
    }

    /// The attachments blob (empty when the stage had no attachments).
    #[getter]
    fn attachments<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.attachments)
    }

    /// Lowercase hex SHA-256 of row and attachments: equal exactly when two stages of a key
    /// carry the same content (what idempotency and conflict compare).
    #[getter]
    fn content_digest(&self) -> &str {
        &self.content_digest
    }

    #[getter]
    fn has_attachments(&self) -> bool {
        self.has_attachments
    }
}

/// Verify a staged record (every digest recomputed) and encode it and its attachments.
///
/// The verification, the encoding and the content digest run in one release of the GIL: each
/// release is a handoff to another thread and back, which costs more than a W1 row's hashing
/// when many threads stage at once (PostgresStagingStore's stage path).
#[pyfunction]
#[pyo3(signature = (record, attachments = None))]
fn staging_encode(
    py: Python<'_>,
    record: &Bound<'_, PyAny>,
    attachments: Option<&Bound<'_, PyAny>>,
) -> PyResult<StagedRow> {
    let none = py.None().into_bound(py);
    let call = call_of_record(record)?;
    let attachments = attachments_of(attachments.unwrap_or(&none))?;
    let has_attachments = attachments.is_some();
    let (row, blob, content_digest) = py
        .detach(|| {
            verified(&call)?;
            let row = row::encode_row(&call);
            let blob = attachments
                .as_deref()
                .map(row::encode_attachments)
                .unwrap_or_default();
            let digest = hex::encode(row::content_digest(&row, &blob));
            Ok((row, blob, digest))
        })
        .map_err(|e| staging_err(py, e))?;
    Ok(StagedRow {
        key: call.key(),
        rollout_id: call.fields.rollout_id,
        model_call_id: call.fields.model_call_id,
        row,
        attachments: blob,
        has_attachments,
        content_digest,
    })
}

fn hex_str<'py>(py: Python<'py>, d: &Digest32) -> Bound<'py, PyString> {
    let mut text = [0u8; 64];
    hex::encode_to_slice(d, &mut text).expect("64 hex digits for 32 bytes");
    PyString::new(
        py,
        std::str::from_utf8(&text).expect("hex digits are ASCII"),
    )
}

/// A list of floats where every exact `0.0` and `1.0` (by bits: `-0.0` stays its own object) is
/// one shared object: a staged mask holds nothing else and a prompt carry's log-probs are
/// `0.0`, so a fetch allocates a float only for generated log-probs (float objects are
/// immutable; sharing equal ones is what a Python literal does too).
fn float_list<'py>(
    py: Python<'py>,
    values: impl ExactSizeIterator<Item = f64>,
) -> PyResult<Bound<'py, PyList>> {
    let zero = PyFloat::new(py, 0.0).into_any();
    let one = PyFloat::new(py, 1.0).into_any();
    let items = values.map(|v| {
        if v.to_bits() == 0f64.to_bits() {
            zero.clone()
        } else if v.to_bits() == 1f64.to_bits() {
            one.clone()
        } else {
            PyFloat::new(py, v).into_any()
        }
    });
    PyList::new(py, items)
}

/// The model fields of a row, as a dict (`model_construct(**fields)` builds the model; the
/// row is verified natively, see [`verified_dicts`]). `extras`: `None` leaves the key out.
fn fields_dict<'py>(
    py: Python<'py>,
    view: &BaseView<'_>,
    extras: Option<Option<&[(String, Extra)]>>,
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    let head = &view.head;
    d.set_item(intern!(py, "schema_version"), head.schema_version)?;
    d.set_item(intern!(py, "digest_version"), head.digest_version)?;
    d.set_item(
        intern!(py, "extras_digest_version"),
        head.extras_digest_version,
    )?;
    d.set_item(intern!(py, "rollout_id"), head.rollout_id)?;
    d.set_item(intern!(py, "model_call_id"), head.model_call_id)?;
    d.set_item(intern!(py, "parent_call_id"), head.parent_call_id)?;
    d.set_item(intern!(py, "mode"), head.mode.as_str())?;
    d.set_item(intern!(py, "prev_len"), head.prev_len)?;
    d.set_item(intern!(py, "delta_len"), head.delta_len)?;
    d.set_item(intern!(py, "cum_len"), head.cum_len)?;
    d.set_item(intern!(py, "weight_version"), head.weight_version)?;
    d.set_item(intern!(py, "digest"), hex_str(py, &view.digest))?;
    // Through `PyLong_FromLong` where an id fits (CPython's fast path for one-digit ints,
    // ~15% cheaper than `PyLong_FromUnsignedLongLong`'s general one).
    let ids = view.token_ids().map(|id| {
        let int = match i64::try_from(id) {
            Ok(small) => small.into_pyobject(py),
            Err(_) => id.into_pyobject(py),
        };
        let Ok(int) = int;
        int
    });
    d.set_item(intern!(py, "token_ids_delta"), PyList::new(py, ids)?)?;
    d.set_item(
        intern!(py, "token_mask_delta"),
        float_list(py, view.token_mask())?,
    )?;
    d.set_item(
        intern!(py, "generation_log_probs_delta"),
        float_list(py, view.log_probs())?,
    )?;
    d.set_item(
        intern!(py, "extras_digest"),
        hex_str(py, head.extras_digest),
    )?;
    d.set_item(intern!(py, "chain_hash"), hex_str(py, head.chain_hash))?;
    d.set_item(
        intern!(py, "cumulative_hash"),
        hex_str(py, head.cumulative_hash),
    )?;
    if let Some(extras) = extras {
        match extras {
            None => d.set_item(intern!(py, "extras"), py.None())?,
            Some(entries) => d.set_item(intern!(py, "extras"), map_to_py(py, entries)?)?,
        }
    }
    Ok(d)
}

/// Verify one row: its checksum (unless `summed`: matched already over these bytes, see
/// `StoredRow::checksum_verified`), its staging digest, the extras digest with `with_extras`,
/// and that it is the row of `key`.
fn verify_row(r: &[u8], key: &str, with_extras: bool, summed: bool) -> Result<(), String> {
    let verified = if summed {
        row::verify_stored_summed(r, key, with_extras)
    } else {
        row::verify_stored(r, key, with_extras)
    };
    verified.map_err(|e| format!("staged row of {key:?} is damaged: {e}"))
}

/// Row bytes worth the helper thread: below this a fetch verifies, then builds, on one thread
/// (waking the helper and sharing the rows with it costs about what verifying a few rows does).
const PARALLEL_VERIFY_BYTES: usize = 64 << 10;

/// The field dicts of `rows` (the rows of `keys`, in order), each verified by [`verify_row`];
/// `Ok(Err((i, message)))` when row `i` does not verify, and then nothing built is returned.
///
/// The dicts are built from the row bytes as they read ([`row::view_unverified`]: bounded and
/// panic-free on any bytes), and returned only once every row verified: a small fetch
/// verifies first (detached); a large one hands the rows to the process's helper thread,
/// which verifies them while this one (holding the GIL) builds, then verifies whatever rows
/// the helper has not taken (`crate::split`: on a loaded machine this thread may do them all).
///
/// `summed[i]`: row `i`'s own checksum was matched already (empty: none was).
fn verified_dicts<'py, R: AsRef<[u8]> + Send + Sync + 'static>(
    py: Python<'py>,
    rows: Vec<R>,
    keys: Vec<String>,
    with_extras: bool,
    summed: Vec<bool>,
) -> PyResult<Result<Bound<'py, PyList>, (usize, String)>> {
    let total: usize = rows.iter().map(|r| r.as_ref().len()).sum();
    let (built, verdicts) = if total < PARALLEL_VERIFY_BYTES {
        let verdicts = py.detach(|| {
            rows.iter()
                .zip(&keys)
                .enumerate()
                .map(|(i, (r, key))| {
                    let done = summed.get(i).copied().unwrap_or(false);
                    verify_row(r.as_ref(), key, with_extras, done)
                })
                .collect::<Vec<_>>()
        });
        if verdicts.iter().all(Result::is_ok) {
            (unverified_to_py(py, &rows, with_extras), verdicts)
        } else {
            (Ok(None), verdicts)
        }
    } else {
        let count = rows.len();
        let split = Split::start(
            (rows, keys, with_extras, summed),
            count,
            |(rows, keys, with_extras, summed), i| {
                let done = summed.get(i).copied().unwrap_or(false);
                verify_row(rows[i].as_ref(), &keys[i], *with_extras, done)
            },
        );
        let built = unverified_to_py(py, &split.data().0, with_extras);
        (built, py.detach(|| split.finish()))
    };
    if let Some((i, Err(m))) = verdicts.into_iter().enumerate().find(|(_, v)| v.is_err()) {
        return Ok(Err((i, m)));
    }
    match built? {
        Some(list) => Ok(Ok(list)),
        None => Ok(Err((0, "staged rows verified but did not decode".into()))),
    }
}

/// The field dicts of rows read *without verification* (`None` at the first row that does
/// not parse): only [`verified_dicts`] calls this, and returns nothing of it unless every row
/// verified.
fn unverified_to_py<'py, R: AsRef<[u8]>>(
    py: Python<'py>,
    rows: &[R],
    with_extras: bool,
) -> PyResult<Option<Bound<'py, PyList>>> {
    let mut dicts = Vec::with_capacity(rows.len());
    for r in rows {
        let Ok((view, extras)) = row::view_unverified(r.as_ref(), with_extras) else {
            return Ok(None);
        };
        let extras = extras.as_ref().map(|e| e.as_deref());
        dicts.push(fields_dict(py, &view, extras)?);
    }
    PyList::new(py, dicts).map(Some)
}

/// Decode and verify stored rows (from any backend): a list of field dicts, in order. A row
/// that does not verify raises `TokenCaptureCorruptionError` naming its key.
#[pyfunction]
#[pyo3(signature = (rows, keys, with_extras = false))]
fn staging_decode<'py>(
    py: Python<'py>,
    rows: Vec<Vec<u8>>,
    keys: Vec<String>,
    with_extras: bool,
) -> PyResult<Bound<'py, PyList>> {
    if rows.len() != keys.len() {
        return value_err(format!("{} rows for {} keys", rows.len(), keys.len()));
    }
    verified_dicts(py, rows, keys, with_extras, Vec::new())?.map_err(|(_, m)| CORRUPT.err(py, m))
}

/// Decoded attachments as Python gets them, each in its canonical form
/// ([`Attachment::canonical`]: plain bytes come back as `"bytes"`, whatever bytes-like type, or
/// build, staged them).
fn attachments_to_py<'py>(py: Python<'py>, list: Vec<Attachment>) -> PyResult<Bound<'py, PyList>> {
    let out = PyList::empty(py);
    for a in row::canonical_attachments(list) {
        let buffers = PyList::empty(py);
        for b in &a.buffers {
            buffers.append(PyBytes::new(py, b))?;
        }
        let tuple = (
            &a.name,
            a.kind.as_str(),
            &a.format,
            &a.dtype,
            a.shape.clone(),
            buffers,
        )
            .into_pyobject(py)?;
        out.append(tuple)?;
    }
    Ok(out)
}

/// Decode an attachments blob: `(name, kind, format, dtype, shape, [bytes])` tuples.
#[pyfunction]
fn staging_decode_attachments<'py>(
    py: Python<'py>,
    blob: Vec<u8>,
    key: String,
) -> PyResult<Bound<'py, PyList>> {
    let list = py
        .detach(|| row::decode_attachments(&blob))
        .map_err(|e| CORRUPT.err(py, format!("attachments of {key:?} are damaged: {e}")))?;
    attachments_to_py(py, list)
}

/// Whether two stages of a key, as stored (`row`, attachments blob), carry the same call: the
/// same row and the same attachments in their canonical form, an older build's empty list
/// being none (`row::same_content`). What a backend whose content digests differ asks before
/// it calls a restage a conflict.
#[pyfunction]
fn staging_same_content(
    py: Python<'_>,
    row_a: Vec<u8>,
    attachments_a: Vec<u8>,
    row_b: Vec<u8>,
    attachments_b: Vec<u8>,
) -> bool {
    py.detach(|| row::same_content(&row_a, &attachments_a, &row_b, &attachments_b))
}

// ---- the file store ------------------------------------------------------------------------

/// The native file staging store; `tokencapture.staging.FileStagingStore` wraps it.
///
/// Per process: a forked child opens its own store on the same root at its first call and
/// never touches the parent's (see `crate::fork`).
#[pyclass(frozen, name = "StagingFileStore", module = "tokencapture._core")]
pub(super) struct PyStagingFileStore {
    handle: PerProcess<FileStaging, StagingError>,
}

impl PyStagingFileStore {
    /// This process's store.
    fn inner(&self, py: Python<'_>) -> PyResult<Arc<FileStaging>> {
        self.handle.get().map_err(|e| staging_err(py, e))
    }
}

#[pymethods]
impl PyStagingFileStore {
    #[new]
    #[pyo3(signature = (root, max_open_files = None))]
    fn new(py: Python<'_>, root: PathBuf, max_open_files: Option<usize>) -> PyResult<Self> {
        let handle = py
            .detach(|| {
                PerProcess::open(move || FileStaging::open_with(root.clone(), max_open_files))
            })
            .map_err(|e| staging_err(py, e))?;
        Ok(PyStagingFileStore { handle })
    }

    /// Verify, encode and durably stage one record (and its attachments); returns its key.
    #[pyo3(signature = (record, attachments = None))]
    fn stage(
        &self,
        py: Python<'_>,
        record: &Bound<'_, PyAny>,
        attachments: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<String> {
        let inner = self.inner(py)?;
        let call = call_of_record(record)?;
        let none = py.None().into_bound(py);
        let attachments = attachments_of(attachments.unwrap_or(&none))?;
        let store = &inner;
        py.detach(|| {
            verified(&call)?;
            let blob = attachments
                .as_deref()
                .map(row::encode_attachments)
                .unwrap_or_default();
            let frame = Frame::new(&call, &blob);
            let key = frame.key.clone();
            store.stage(frame).map(|()| key)
        })
        .map_err(|e| staging_err(py, e))
    }

    /// Base snapshots (or whole records with `with_extras`) of `keys`, in order, as field
    /// dicts, each digest-verified.
    #[pyo3(signature = (keys, with_extras = false))]
    fn fetch<'py>(
        &self,
        py: Python<'py>,
        keys: Vec<String>,
        with_extras: bool,
    ) -> PyResult<Bound<'py, PyList>> {
        let inner = self.inner(py)?;
        let store = &inner;
        // Keys this view holds none of (a fresh store's first fetch, or calls staged since its
        // last fold): the fold's tails are read and every check of them and of the rows runs on
        // the helper thread while this thread builds the answer; returned only if the fold
        // indexed those very rows for the keys and every check passed.
        let pending = py
            .detach(|| store.begin_fetch(&keys, with_extras))
            .map_err(|e| staging_err(py, e))?;
        if let Some(pending) = pending {
            let built = unverified_to_py(py, &pending.rows(), with_extras)?;
            let outcome = py
                .detach(|| store.finish_fetch(pending))
                .map_err(|e| staging_err(py, e))?;
            match (outcome, built) {
                (FetchOutcome::Verified, Some(list)) => return Ok(list),
                (
                    FetchOutcome::Damaged {
                        path,
                        offset,
                        message,
                        ..
                    },
                    _,
                ) => {
                    return Err(staging_err(
                        py,
                        StagingError::Corrupt(crate::Error::corrupt(&path, offset, message)),
                    ))
                }
                // Not the rows indexed (or rows that did not parse): the ordinary way.
                _ => {}
            }
        }
        let rows = py
            .detach(|| store.fetch_stored_rows(&keys))
            .map_err(|e| staging_err(py, e))?;
        let mut bytes = Vec::with_capacity(rows.len());
        let mut summed = Vec::with_capacity(rows.len());
        let mut places = Vec::with_capacity(rows.len());
        for r in rows {
            bytes.push(r.bytes);
            summed.push(r.checksum_verified);
            places.push((r.path, r.offset));
        }
        verified_dicts(py, bytes, keys, with_extras, summed)?.map_err(|(i, m)| {
            let (path, offset) = &places[i];
            staging_err(
                py,
                StagingError::Corrupt(crate::Error::corrupt(path, *offset, m)),
            )
        })
    }

    /// The attachments of one key: `(name, kind, format, dtype, shape, [bytes])` tuples.
    fn fetch_attachments<'py>(&self, py: Python<'py>, key: String) -> PyResult<Bound<'py, PyList>> {
        let inner = self.inner(py)?;
        let store = &inner;
        let list = py
            .detach(|| -> Result<Vec<Attachment>, StagingError> {
                let blob = store.fetch_attachments_blob(&key)?;
                row::decode_attachments(&blob).map_err(|e| {
                    StagingError::Corrupt(crate::Error::corrupt(
                        store.root(),
                        0,
                        format!("attachments of {key:?} are damaged: {e}"),
                    ))
                })
            })
            .map_err(|e| staging_err(py, e))?;
        attachments_to_py(py, list)
    }

    /// Fence a batch of rollouts; `(removed, absent)`.
    fn retire(
        &self,
        py: Python<'_>,
        rollout_ids: Vec<String>,
    ) -> PyResult<(Vec<String>, Vec<String>)> {
        let inner = self.inner(py)?;
        py.detach(|| inner.retire(&rollout_ids))
            .map(|r| (r.removed, r.absent))
            .map_err(|e| staging_err(py, e))
    }

    /// Delete a batch of rollouts (data hidden, fence lifted); `(removed, absent)`.
    fn delete(
        &self,
        py: Python<'_>,
        rollout_ids: Vec<String>,
    ) -> PyResult<(Vec<String>, Vec<String>)> {
        let inner = self.inner(py)?;
        py.detach(|| inner.delete(&rollout_ids))
            .map(|r| (r.removed, r.absent))
            .map_err(|e| staging_err(py, e))
    }

    /// Visible keys (of one rollout, or all), sorted.
    #[pyo3(signature = (rollout_id = None))]
    fn keys(&self, py: Python<'_>, rollout_id: Option<String>) -> PyResult<Vec<String>> {
        let inner = self.inner(py)?;
        py.detach(|| inner.keys(rollout_id.as_deref()))
            .map_err(|e| staging_err(py, e))
    }

    /// Every retired rollout id, sorted.
    fn retired(&self, py: Python<'_>) -> PyResult<Vec<String>> {
        let inner = self.inner(py)?;
        py.detach(|| inner.retired())
            .map_err(|e| staging_err(py, e))
    }

    /// `(batches, frames, syncs)` committed by this instance.
    fn stats(&self, py: Python<'_>) -> PyResult<(u64, u64, u64)> {
        let s = self.inner(py)?.stats();
        Ok((s.batches, s.frames, s.syncs))
    }

    /// Descriptors this store keeps between calls (its segment, its store lock).
    fn open_files(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.inner(py)?.open_files())
    }

    /// This store's own cap on kept descriptors; None when only the process budget applies.
    fn max_open_files(&self, py: Python<'_>) -> PyResult<Option<usize>> {
        Ok(self.inner(py)?.max_open_files())
    }

    /// Damaged ranges of acknowledged frames: `(segment, start, end)` byte offsets.
    fn damage(&self, py: Python<'_>) -> PyResult<Vec<(String, u64, u64)>> {
        let inner = self.inner(py)?;
        let found = py
            .detach(|| inner.damage())
            .map_err(|e| staging_err(py, e))?;
        Ok(found
            .into_iter()
            .map(|d| (d.segment, d.start, d.end))
            .collect())
    }

    /// The segment files this instance knows, once it has folded in the directory (an open
    /// reads nothing).
    fn segment_names(&self, py: Python<'_>) -> PyResult<Vec<String>> {
        let inner = self.inner(py)?;
        py.detach(|| inner.refresh())
            .map_err(|e| staging_err(py, e))?;
        Ok(inner.segment_names())
    }

    /// Close the kept store lock (the segment being written stays open).
    fn release_cached_fds(&self, py: Python<'_>) -> PyResult<()> {
        self.inner(py)?.release_cached_fds();
        Ok(())
    }

    #[getter]
    fn root(&self, py: Python<'_>) -> PyResult<PathBuf> {
        Ok(self.inner(py)?.root().to_path_buf())
    }
}

pub(super) fn register(module: &Bound<'_, PyModule>) -> PyResult<()> {
    module.add_class::<PyStagingFileStore>()?;
    module.add_class::<StagedRow>()?;
    module.add_function(wrap_pyfunction!(staging_hash_token_ids, module)?)?;
    module.add_function(wrap_pyfunction!(staging_encode_token_ids, module)?)?;
    module.add_function(wrap_pyfunction!(staging_chain_hash, module)?)?;
    module.add_function(wrap_pyfunction!(staging_extras_digest, module)?)?;
    module.add_function(wrap_pyfunction!(staging_digest, module)?)?;
    module.add_function(wrap_pyfunction!(staging_encode, module)?)?;
    module.add_function(wrap_pyfunction!(staging_decode, module)?)?;
    module.add_function(wrap_pyfunction!(staging_decode_attachments, module)?)?;
    module.add_function(wrap_pyfunction!(staging_same_content, module)?)?;
    Ok(())
}
