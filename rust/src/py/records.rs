//! Entry-level helpers: token and payload digests, the type rules of an entry's fields and
//! the scan of its values before it is stored, and rollout-id validation.

use pyo3::buffer::PyBuffer;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyList, PyString, PyTuple};

use super::errors::text;
use crate::digest;
use crate::store;

/// Signed token ids as u64, refusing a negative one.
fn non_negative<T: Into<i64>>(ids: Vec<T>) -> PyResult<Vec<u64>> {
    ids.into_iter()
        .map(|id| {
            let id: i64 = id.into();
            u64::try_from(id)
                .map_err(|_| PyValueError::new_err(format!("token id {id} is negative")))
        })
        .collect()
}

/// Token ids from a list/tuple of ints or a buffer of integers, as u64.
pub(super) fn token_ids(ids: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
    let out_of_range = |item: &Bound<'_, PyAny>| {
        PyValueError::new_err(format!("token id {item} is outside 0..=2**64-1"))
    };
    let extract = |item: Bound<'_, PyAny>| -> PyResult<u64> {
        match item.extract::<u64>() {
            Ok(id) => Ok(id),
            Err(err) if err.is_instance_of::<pyo3::exceptions::PyOverflowError>(item.py()) => {
                Err(out_of_range(&item))
            }
            Err(err) => Err(err),
        }
    };
    if let Ok(list) = ids.cast::<PyList>() {
        return list.iter().map(extract).collect();
    }
    if let Ok(tuple) = ids.cast::<PyTuple>() {
        return tuple.iter().map(extract).collect();
    }
    let py = ids.py();
    if let Ok(buffer) = PyBuffer::<u64>::get(ids) {
        return buffer.to_vec(py);
    }
    if let Ok(buffer) = PyBuffer::<u32>::get(ids) {
        return Ok(buffer.to_vec(py)?.into_iter().map(u64::from).collect());
    }
    if let Ok(buffer) = PyBuffer::<i64>::get(ids) {
        return non_negative(buffer.to_vec(py)?);
    }
    if let Ok(buffer) = PyBuffer::<i32>::get(ids) {
        return non_negative(buffer.to_vec(py)?);
    }
    ids.try_iter()?.map(|item| extract(item?)).collect()
}

/// Lowercase hex token digest of a sequence (list, tuple, buffer or iterable) of ids.
#[pyfunction]
pub(super) fn compute_digest(py: Python<'_>, token_ids_: &Bound<'_, PyAny>) -> PyResult<String> {
    let ids = token_ids(token_ids_)?;
    Ok(py.detach(|| digest::token_digest(&ids)))
}

/// Lowercase hex SHA-256 of a canonical line (the payload digest).
#[pyfunction]
pub(super) fn payload_digest(py: Python<'_>, line: &[u8]) -> String {
    py.detach(|| digest::payload_digest(line))
}

/// Deepest nesting a stored value may have. pydantic's JSON reader stops at about 200 levels,
/// so anything deeper would be acknowledged and then unreadable.
const MAX_JSON_DEPTH: usize = 128;

/// Why a value cannot be stored; `path` is filled in (innermost first) while unwinding, so
/// the common, valid case allocates nothing.
struct ScanError {
    path: Vec<String>,
    problem: String,
}

impl ScanError {
    fn at(mut self, segment: impl FnOnce() -> String) -> Self {
        self.path.push(segment());
        self
    }

    fn into_pyerr(self) -> PyErr {
        let path: Vec<String> = self.path.into_iter().rev().collect();
        PyValueError::new_err(format!("{} {}", path.join("."), self.problem))
    }
}

/// Walk `value`: fail at the first non-finite float; return whether everything is a plain
/// JSON type (exact dict with str keys, list, tuple, str, int, float, bool, None). Plain values
/// serialize with orjson exactly as pydantic's JSON mode would; anything else takes the
/// pydantic path. The walk continues past exotic values so no visible NaN hides behind one.
fn scan_value(value: &Bound<'_, PyAny>, depth: usize) -> Result<bool, ScanError> {
    use pyo3::types::{PyBool, PyDict, PyFloat, PyInt};
    if value.is_exact_instance_of::<PyInt>()
        || value.is_exact_instance_of::<PyString>()
        || value.is_none()
        || value.is_exact_instance_of::<PyBool>()
    {
        return Ok(true);
    }
    if let Ok(float) = value.cast::<PyFloat>() {
        let number = float.value();
        if !number.is_finite() {
            return Err(ScanError {
                path: Vec::new(),
                problem: format!(
                    "is {}: JSON cannot carry non-finite floats, so the entry would not \
                     read back",
                    non_finite_text(number)
                ),
            });
        }
        return Ok(value.is_exact_instance_of::<PyFloat>());
    }
    if depth > MAX_JSON_DEPTH {
        return Err(ScanError {
            path: Vec::new(),
            problem: format!("is nested deeper than {MAX_JSON_DEPTH} levels"),
        });
    }
    let mut plain = true;
    if let Ok(list) = value.cast_exact::<PyList>() {
        for (index, item) in list.iter().enumerate() {
            plain &= scan_value(&item, depth + 1).map_err(|e| e.at(|| index.to_string()))?;
        }
    } else if let Ok(tuple) = value.cast_exact::<PyTuple>() {
        for (index, item) in tuple.iter().enumerate() {
            plain &= scan_value(&item, depth + 1).map_err(|e| e.at(|| index.to_string()))?;
        }
    } else if let Ok(dict) = value.cast_exact::<PyDict>() {
        for (key, item) in dict.iter() {
            plain &= key.is_exact_instance_of::<PyString>();
            plain &= scan_value(&item, depth + 1).map_err(|e| e.at(|| key.to_string()))?;
        }
    } else {
        plain = false;
    }
    Ok(plain)
}

/// A non-finite float as Python prints it (`nan`, `inf`, `-inf`), so both stores' messages match.
fn non_finite_text(number: f64) -> &'static str {
    if number.is_nan() {
        "nan"
    } else if number > 0.0 {
        "inf"
    } else {
        "-inf"
    }
}

/// What a top-level field of an entry must hold.
#[derive(Debug, Clone, Copy)]
enum FieldKind {
    Text,
    OptionalText,
    Int,
    OptionalInt,
    Bool,
    /// `created_at`: an int or a float.
    Timestamp,
    /// `parent_resolution`: None or one of the status values.
    Status,
    /// `output_items`: a list of dicts.
    Items,
}

impl FieldKind {
    /// Whether `value` is acceptable (a status is checked against the values by the caller).
    fn accepts(self, value: &Bound<'_, PyAny>) -> bool {
        use pyo3::types::{PyBool, PyDict, PyFloat, PyInt};
        let int = || value.is_instance_of::<PyInt>() && !value.is_instance_of::<PyBool>();
        match self {
            FieldKind::Text => value.is_instance_of::<PyString>(),
            FieldKind::OptionalText => value.is_none() || value.is_instance_of::<PyString>(),
            FieldKind::Int => int(),
            FieldKind::OptionalInt => value.is_none() || int(),
            FieldKind::Bool => value.is_instance_of::<PyBool>(),
            FieldKind::Timestamp => int() || value.is_instance_of::<PyFloat>(),
            FieldKind::Items => value
                .cast::<PyList>()
                .is_ok_and(|items| items.iter().all(|item| item.is_instance_of::<PyDict>())),
            FieldKind::Status => true, // checked against the status values by the caller
        }
    }

    fn expected(self) -> &'static str {
        match self {
            FieldKind::Text => "a str",
            FieldKind::OptionalText => "a str or None",
            FieldKind::Int | FieldKind::OptionalInt => "an int",
            FieldKind::Bool => "a bool",
            FieldKind::Timestamp => "a float",
            FieldKind::Items | FieldKind::Status => "",
        }
    }
}

/// A field name as Rust text (for messages) and as an interned Python string: dict lookups
/// with it hit CPython's identity fast path and cached hash instead of building and hashing a
/// new string per field per put.
#[derive(Debug)]
struct FieldName {
    text: String,
    key: Py<PyString>,
}

impl FieldName {
    fn new(py: Python<'_>, text: String) -> Self {
        let key = PyString::intern(py, &text).unbind();
        FieldName { text, key }
    }
}

/// The type rules of `TokenEntry`'s fields, checked on an entry's values before it is stored
/// and on every decoded record before it is built without a second pydantic validation. The
/// field lists come from the Python model (`tokencapture.records`); the pure-Python reference
/// store applies the same rules in Python.
#[pyclass(frozen, name = "EntryFields", module = "tokencapture._core")]
pub(super) struct EntryFields {
    required: Vec<FieldName>,
    /// In the order the checks run, so the first problem reported is the same every time.
    fields: Vec<(FieldName, FieldKind)>,
    statuses: Vec<String>,
    /// The status values as Python prints a sorted list of them, for error messages.
    statuses_text: String,
}

#[pymethods]
impl EntryFields {
    #[new]
    #[pyo3(signature = (*, required, text, optional_text, ints, optional_ints, bools, statuses))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        required: Vec<String>,
        text: Vec<String>,
        optional_text: Vec<String>,
        ints: Vec<String>,
        optional_ints: Vec<String>,
        bools: Vec<String>,
        mut statuses: Vec<String>,
    ) -> PyResult<Self> {
        let groups = [
            (text, FieldKind::Text),
            (optional_text, FieldKind::OptionalText),
            (ints, FieldKind::Int),
            (optional_ints, FieldKind::OptionalInt),
            (bools, FieldKind::Bool),
        ];
        let mut fields: Vec<(String, FieldKind)> = groups
            .into_iter()
            .flat_map(|(names, kind)| names.into_iter().map(move |name| (name, kind)))
            .collect();
        fields.push(("created_at".to_owned(), FieldKind::Timestamp));
        fields.push(("parent_resolution".to_owned(), FieldKind::Status));
        fields.push(("output_items".to_owned(), FieldKind::Items));
        let fields = fields
            .into_iter()
            .map(|(name, kind)| (FieldName::new(py, name), kind))
            .collect();
        statuses.sort();
        let statuses_text = PyList::new(py, &statuses)?.repr()?.to_string();
        Ok(EntryFields {
            required: required
                .into_iter()
                .map(|name| FieldName::new(py, name))
                .collect(),
            fields,
            statuses,
            statuses_text,
        })
    }

    /// Refuse field values that would not read back as a valid entry (`ValueError`). With
    /// `deep`, also walk every value (non-finite floats, nesting, the token arrays' item types)
    /// and return whether all of it is plain JSON, which orjson serializes exactly as
    /// pydantic's JSON mode would.
    #[pyo3(signature = (values, deep = false))]
    fn check(&self, values: &Bound<'_, pyo3::types::PyDict>, deep: bool) -> PyResult<bool> {
        let py = values.py();
        let mut missing = Vec::new();
        for name in &self.required {
            if !values.contains(name.key.bind(py))? {
                missing.push(name.text.as_str());
            }
        }
        if !missing.is_empty() {
            return Err(PyValueError::new_err(format!(
                "missing field(s) {}",
                missing.join(", ")
            )));
        }
        for (name, kind) in &self.fields {
            let Some(value) = values.get_item(name.key.bind(py))? else {
                continue;
            };
            let name = &name.text;
            if let FieldKind::Status = kind {
                let known = value.is_none()
                    || value
                        .cast::<PyString>()
                        .ok()
                        .and_then(|status| status.to_str().ok())
                        .is_some_and(|status| self.statuses.iter().any(|known| known == status));
                if !known {
                    return Err(PyValueError::new_err(format!(
                        "parent_resolution {} is not one of {}",
                        value.repr()?,
                        self.statuses_text
                    )));
                }
            } else if !kind.accepts(&value) {
                return Err(PyValueError::new_err(match kind {
                    FieldKind::Items => "output_items must be a list of dicts".to_owned(),
                    _ => format!(
                        "{name} must be {}, got {}",
                        kind.expected(),
                        type_name(&value)
                    ),
                }));
            }
        }
        if deep {
            return scan_entry_values(values);
        }
        Ok(true)
    }
}

/// Walk an entry's values before serialization (see `scan_value`). The token arrays get a
/// dedicated pass that also checks their item types: entries built with `model_construct`, or
/// mutated after validation, reach `put` unchecked otherwise, and a bool (`true`) would not
/// read back as the same bytes.
fn scan_entry_values(values: &Bound<'_, pyo3::types::PyDict>) -> PyResult<bool> {
    let mut plain = true;
    for (key, value) in values.iter() {
        let key_text = key.cast::<PyString>().ok();
        let name = key_text.and_then(|k| k.to_str().ok());
        let value_plain = match name {
            Some(field @ ("prompt_token_ids" | "generation_token_ids")) => {
                scan_token_ids(&value, field)?
            }
            Some("generation_log_probs") => scan_log_probs(&value)?,
            // A float field holding an int: pydantic's JSON mode writes `7.0`, orjson `7`.
            Some("created_at") if !value.is_instance_of::<pyo3::types::PyFloat>() => {
                scan_value(&value, 1).map_err(|e| e.at(|| key.to_string()).into_pyerr())?;
                false
            }
            _ => scan_value(&value, 1).map_err(|e| e.at(|| key.to_string()).into_pyerr())?,
        };
        plain &= value_plain && key.is_exact_instance_of::<PyString>();
    }
    Ok(plain)
}

/// Token ids: a list of ints (bools refused). Plain when every item is an exact int.
fn scan_token_ids(value: &Bound<'_, PyAny>, field: &str) -> PyResult<bool> {
    use pyo3::types::{PyBool, PyInt};
    let list = as_list(value, field)?;
    let mut plain = true;
    let mut refused = None;
    for_each_item_type(list, |index, item_type| {
        if item_type == ItemType::Int {
            return true;
        }
        let Ok(item) = list.get_item(index) else {
            return false;
        };
        if !item.is_instance_of::<PyInt>() || item.is_instance_of::<PyBool>() {
            refused = Some(format!(
                "{field}.{index} must be an int, got {}",
                type_name(&item)
            ));
            return false;
        }
        plain = false;
        true
    });
    refused.map_or(Ok(plain), |problem| Err(PyValueError::new_err(problem)))
}

/// Log-probs: a list of finite floats or ints (bools refused).
fn scan_log_probs(value: &Bound<'_, PyAny>) -> PyResult<bool> {
    use pyo3::types::{PyBool, PyFloat, PyInt};
    let field = "generation_log_probs";
    let list = as_list(value, field)?;
    let mut plain = true;
    let mut refused = None;
    for_each_item_type(list, |index, item_type| {
        if let ItemType::Float(number) = item_type {
            if number.is_finite() {
                return true;
            }
        } else if item_type == ItemType::Int {
            // Not plain: pydantic's JSON mode writes it as a float (`-2.0`), orjson would not.
            plain = false;
            return true;
        }
        let Ok(item) = list.get_item(index) else {
            return false;
        };
        if let Ok(float) = item.cast::<PyFloat>() {
            let number = float.value();
            if !number.is_finite() {
                refused = Some(format!(
                    "{field}.{index} is {}: JSON cannot carry non-finite floats, so the \
                     entry would not read back",
                    non_finite_text(number)
                ));
                return false;
            }
            plain &= item.is_exact_instance_of::<PyFloat>();
        } else if item.is_instance_of::<PyInt>() && !item.is_instance_of::<PyBool>() {
            plain = false;
        } else {
            refused = Some(format!(
                "{field}.{index} must be a float, got {}",
                type_name(&item)
            ));
            return false;
        }
        true
    });
    refused.map_or(Ok(plain), |problem| Err(PyValueError::new_err(problem)))
}

/// The exact type of a list item, as far as the token-array scans care.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum ItemType {
    /// Exactly `int`.
    Int,
    /// Exactly `float`, with its value.
    Float(f64),
    /// Anything else, subclasses included: the caller looks at the item itself.
    Other,
}

/// Call `visit(index, type)` for each item of `list` in order until it returns false.
///
/// Every put scans its token arrays (hundreds to tens of thousands of items), and readers
/// check decoded token fields the same way. Under abi3, PyO3's safe list iterator costs four
/// calls into libpython per item (size, get, incref, decref): ~6 us of a W1 put's ~10 us type
/// check. Reading each item's type through a borrowed reference costs one call per item
/// (~1 us for the same entry).
pub(super) fn for_each_item_type(
    list: &Bound<'_, PyList>,
    mut visit: impl FnMut(usize, ItemType) -> bool,
) {
    use pyo3::ffi;
    let len = list.len();
    for index in 0..len {
        // SAFETY: we are attached to the interpreter and hold a reference to `list`, so it is
        // alive. `PyList_GetItem` checks the index (NULL if the list shrank) and returns a
        // borrowed reference; no Python code runs between taking it and the last read of the
        // item in this block, so the item is alive while we read its type and a float's value.
        let item_type = unsafe {
            let item = ffi::PyList_GetItem(list.as_ptr(), index as ffi::Py_ssize_t);
            if item.is_null() {
                ffi::PyErr_Clear();
                ItemType::Other
            } else {
                let object_type = ffi::Py_TYPE(item);
                if object_type == &raw mut ffi::PyLong_Type {
                    ItemType::Int
                } else if object_type == &raw mut ffi::PyFloat_Type {
                    ItemType::Float(ffi::PyFloat_AsDouble(item))
                } else {
                    ItemType::Other
                }
            }
        };
        if !visit(index, item_type) {
            return;
        }
    }
}

fn as_list<'a, 'py>(value: &'a Bound<'py, PyAny>, field: &str) -> PyResult<&'a Bound<'py, PyList>> {
    value.cast::<PyList>().map_err(|_| {
        PyValueError::new_err(format!("{field} must be a list, got {}", type_name(value)))
    })
}

fn type_name(value: &Bound<'_, PyAny>) -> String {
    value
        .get_type()
        .name()
        .map_or_else(|_| "an unknown type".to_owned(), |name| name.to_string())
}

/// Raise ValueError unless `rollout_id` is a valid rollout id.
#[pyfunction]
pub(super) fn validate_rollout_id(rollout_id: &Bound<'_, PyString>) -> PyResult<()> {
    let rollout_id = text(rollout_id, "rollout_id")?;
    store::validate_rollout_id(rollout_id).map_err(|e| PyValueError::new_err(e.to_string()))
}
