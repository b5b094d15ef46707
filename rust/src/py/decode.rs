//! Freeze and reads (and `decode_lines`, for a log another backend fetched) hand back Python
//! dicts built straight from the verified bytes by the same validating walk the store uses
//! (`json::build`), with no intermediate tree. Token ids repeat heavily within
//! a rollout (every prompt contains the previous prompt and answer): the walk carries a
//! `json::Repeats`, so a repeated run of ids is copied from the earlier list (a C loop of
//! increments) rather than parsed.

use std::ops::Range;
use std::path::Path;

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::pybacked::PyBackedBytes;
use pyo3::types::{PyBytes, PyList, PyString};

use super::errors::to_pyerr;
use super::records::{for_each_item_type, ItemType};
use crate::error::Error;
use crate::fetched::FetchedLog;
use crate::json::tape::TapeFeed;
use crate::store::{self, LinesToDecode};

/// Decoded records and the byte offset of each line: the offsets let Python name the exact
/// place of a record that is not a valid entry.
pub(super) type DecodedRecords<'py> = (Bound<'py, PyList>, Vec<usize>);

struct PyBuilder<'py> {
    py: Python<'py>,
}

/// A list while its items are built. A token list usually begins with the whole of an
/// earlier one (every prompt repeats the previous prompt); that list is then only noted, and
/// the result made at the end in one allocation of its final size (`earlier + tail`), instead
/// of a copy of the prefix grown by appends: growing a long list reallocates it, and glibc
/// moves a large block with `mremap`, whose TLB flush interrupts the other core (measured on
/// a 128-call rollout's freeze, docs/benchmarks.md).
struct PyItems<'py> {
    /// The list this one begins with, and how many of its items.
    prefix: Option<(Bound<'py, PyList>, usize)>,
    /// The items after the prefix (all of them when there is none).
    tail: Bound<'py, PyList>,
}

impl From<crate::json::LineError> for PyErr {
    fn from(err: crate::json::LineError) -> PyErr {
        PyValueError::new_err(err.0)
    }
}

/// A decoded value, and whether it is a list of non-negative integers (the walk saw every item
/// take the integer fast path): token arrays are then known to be ints without a second pass.
type Decoded<'py> = (Bound<'py, PyAny>, bool);

/// Top-level fields whose types the decoder checks as it builds them, so freeze need not
/// walk the token arrays again in Python.
const TOKEN_ID_FIELDS: [&str; 2] = ["prompt_token_ids", "generation_token_ids"];

impl<'py> PyBuilder<'py> {
    fn plain(value: Bound<'py, PyAny>) -> Decoded<'py> {
        (value, false)
    }

    /// A top-level field as the entry holds it: a token field of the wrong shape refused,
    /// naming it, and the float fields' integers made floats (`-1` in the log-probs, `7` as
    /// `created_at`: what NeMo Gym's validation, and our columns, read them as; our writer
    /// and NeMo Gym's never write them so, but a hand-made or foreign line may).
    fn top_level(&self, key: &str, value: Decoded<'py>) -> PyResult<Decoded<'py>> {
        let object = &value.0;
        if key == "created_at" && object.is_exact_instance_of::<pyo3::types::PyInt>() {
            let number: f64 = object.extract()?;
            return Ok(Self::plain(
                pyo3::types::PyFloat::new(self.py, number).into_any(),
            ));
        }
        if key != "generation_log_probs" {
            self.check_top_level(key, &value)?;
            return Ok(value);
        }
        // One pass over the log-probs: each a float or an int, the ints noted.
        let mut ints = Vec::new();
        let mut floats = false;
        if let Ok(list) = object.cast::<PyList>() {
            floats = true;
            for_each_item_type(list, |index, item_type| match item_type {
                ItemType::Float(_) => true,
                ItemType::Int => {
                    ints.push(index);
                    true
                }
                ItemType::Other => {
                    floats = false;
                    false
                }
            });
            for index in ints {
                let number: f64 = list.get_item(index)?.extract()?;
                list.set_item(index, pyo3::types::PyFloat::new(self.py, number))?;
            }
        }
        if !floats {
            return Err(PyValueError::new_err(format!(
                "{key} must be a list of floats"
            )));
        }
        Ok(value)
    }

    /// Refuse a top-level token-id field of the wrong shape, naming it (one the walk saw as
    /// a list of non-negative ints needs no second look).
    fn check_top_level(&self, key: &str, value: &Decoded<'py>) -> PyResult<()> {
        let (object, unsigned_list) = value;
        if *unsigned_list || !TOKEN_ID_FIELDS.contains(&key) {
            return Ok(());
        }
        let mut ints = false;
        if let Ok(list) = object.cast::<PyList>() {
            ints = true;
            for_each_item_type(list, |_, item_type| {
                ints = item_type == ItemType::Int;
                ints
            });
        }
        if ints {
            Ok(())
        } else {
            Err(PyValueError::new_err(format!(
                "{key} must be a list of ints"
            )))
        }
    }
}

impl<'py> crate::json::Builder<'_> for PyBuilder<'py> {
    type Value = Decoded<'py>;
    type Items = PyItems<'py>;
    type Error = PyErr;

    fn null(&mut self) -> PyResult<Self::Value> {
        Ok(Self::plain(self.py.None().into_bound(self.py)))
    }

    fn boolean(&mut self, value: bool) -> PyResult<Self::Value> {
        let value = pyo3::types::PyBool::new(self.py, value)
            .to_owned()
            .into_any();
        Ok(Self::plain(value))
    }

    fn unsigned(&mut self, value: u64, _: &[u8]) -> PyResult<Self::Value> {
        Ok(Self::plain(value.into_pyobject(self.py)?.into_any()))
    }

    fn number(&mut self, text: &[u8], integer: bool) -> PyResult<Self::Value> {
        let text = std::str::from_utf8(text).map_err(|e| PyValueError::new_err(e.to_string()))?;
        if !integer {
            let value: f64 = text
                .parse()
                .map_err(|_| PyValueError::new_err("invalid float"))?;
            return Ok(Self::plain(
                pyo3::types::PyFloat::new(self.py, value).into_any(),
            ));
        }
        match text.parse::<u64>() {
            Ok(value) => self.unsigned(value, text.as_bytes()),
            Err(_) => match text.parse::<i64>() {
                Ok(value) => Ok(Self::plain(value.into_pyobject(self.py)?.into_any())),
                // Beyond 64 bits: Python's own int() parses any length.
                Err(_) => Ok(Self::plain(
                    self.py.get_type::<pyo3::types::PyInt>().call1((text,))?,
                )),
            },
        }
    }

    fn float(&mut self, value: f64, _: &[u8]) -> PyResult<Self::Value> {
        Ok(Self::plain(
            pyo3::types::PyFloat::new(self.py, value).into_any(),
        ))
    }

    fn string(&mut self, raw: &[u8], escaped: bool) -> PyResult<Self::Value> {
        if escaped {
            let text: String =
                serde_json::from_slice(raw).map_err(|e| PyValueError::new_err(e.to_string()))?;
            return Ok(Self::plain(PyString::new(self.py, &text).into_any()));
        }
        let inner = std::str::from_utf8(&raw[1..raw.len() - 1])
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        Ok(Self::plain(PyString::new(self.py, inner).into_any()))
    }

    fn items(&mut self) -> PyResult<Self::Items> {
        Ok(PyItems {
            prefix: None,
            tail: PyList::empty(self.py),
        })
    }

    fn push(&mut self, items: &mut Self::Items, item: Self::Value) -> PyResult<()> {
        items.tail.append(item.0)
    }

    fn reuse(
        &mut self,
        items: &mut Self::Items,
        earlier: &Self::Value,
        count: usize,
    ) -> PyResult<()> {
        let earlier = earlier.0.cast::<PyList>()?;
        if items.prefix.is_none() && items.tail.is_empty() {
            items.prefix = Some((earlier.clone(), count));
            return Ok(());
        }
        // A slice copies the item pointers in one C loop.
        let run = earlier.get_slice(0, count);
        let end = items.tail.len();
        items.tail.as_sequence().set_slice(end, end, &run)
    }

    fn array(&mut self, items: Self::Items, all_unsigned: bool) -> PyResult<Self::Value> {
        let list = match items.prefix {
            None => items.tail,
            // One allocation of the final size; both parts' pointers copied in C loops.
            Some((earlier, count)) if count == earlier.len() => earlier
                .as_sequence()
                .concat(items.tail.as_sequence())?
                .into_any()
                .cast_into::<PyList>()?,
            Some((earlier, count)) => {
                let list = earlier.get_slice(0, count);
                if !items.tail.is_empty() {
                    let end = list.len();
                    list.as_sequence().set_slice(end, end, &items.tail)?;
                }
                list
            }
        };
        if all_unsigned {
            untrack_atomic(list.as_any());
        }
        Ok((list.into_any(), all_unsigned))
    }

    fn object(
        &mut self,
        members: Vec<(Self::Value, Self::Value)>,
        depth: usize,
    ) -> PyResult<Self::Value> {
        let dict = pyo3::types::PyDict::new(self.py);
        for ((key, _), value) in members {
            let value = if depth == 1 {
                self.top_level(key.cast::<PyString>()?.to_str()?, value)?
            } else {
                value
            };
            dict.set_item(key, value.0)?;
        }
        Ok(Self::plain(dict.into_any()))
    }
}

/// Take a list or tuple that holds only ints out of the cycle collector's sight.
///
/// A container of ints cannot be part of a reference cycle, yet every collection of its
/// generation visits each of its items: with the snapshots of a few long rollouts alive (a
/// trainer's batch), collections spent about a fifth of freeze's time walking token lists.
/// CPython makes the same call for tuples and dicts of atomic values (for tuples, lazily, at
/// their first collection); a list could later be made part of a cycle by the caller, which
/// would then only be reclaimed when it is broken by hand.
pub(super) fn untrack_atomic(container: &Bound<'_, PyAny>) {
    // SAFETY: `container` is a live list or tuple (we hold a reference and are attached to the
    // interpreter), a GC type; `PyObject_GC_UnTrack` accepts tracked and untracked objects.
    unsafe { pyo3::ffi::PyObject_GC_UnTrack(container.as_ptr().cast()) }
}

/// Decode `lines` into Python values in one walk (repeated token arrays are reused across
/// lines). A line that fails keeps its own error: it may be a duplicate that no snapshot
/// returns.
fn decode_lines<'b>(
    py: Python<'_>,
    lines: impl IntoIterator<Item = &'b [u8]>,
) -> Vec<PyResult<Py<PyAny>>> {
    let _paused = CollectorPause::new(py);
    let mut builder = PyBuilder { py };
    let mut repeats = crate::json::Repeats::new();
    lines
        .into_iter()
        .map(|line| {
            crate::json::build(line, &mut builder, Some(&mut repeats))
                .map(|(value, _)| value.unbind())
        })
        .collect()
}

/// The lines at `ranges` of `buf`.
fn lines_at<'b>(buf: &'b [u8], ranges: &'b [Range<usize>]) -> impl Iterator<Item = &'b [u8]> {
    ranges.iter().map(|range| &buf[range.clone()])
}

/// Decode the lines a store hands over (attaching to the interpreter): a small log's in one
/// walk, a large log's by replaying the tapes another thread makes while it reads (see
/// `json::tape`).
pub(super) fn decode_in_python(lines: LinesToDecode<'_>) -> Vec<PyResult<Py<PyAny>>> {
    Python::attach(|py| match lines {
        LinesToDecode::Whole { buf, lines } => decode_lines(py, lines_at(buf, lines)),
        LinesToDecode::Taped(feed) => replay_lines(py, feed),
    })
}

/// Build lines from their tapes, which `tapes` yields in order.
fn replay_lines(py: Python<'_>, tapes: TapeFeed<'_>) -> Vec<PyResult<Py<PyAny>>> {
    let _paused = CollectorPause::new(py);
    let mut builder = PyBuilder { py };
    let mut replay = crate::json::tape::Replay::new();
    let mut decoded = Vec::new();
    let mut lines = tapes.iter();
    loop {
        if let Some(side) = tapes.urgent_side_work() {
            py.detach(|| while side.step() {});
        }
        let Some(taped) = lines.next() else { break };
        let value = match &taped.tape {
            Ok(tape) => replay.value(tape, taped.line(), &mut builder),
            Err(err) => Err(PyErr::from(err.clone())),
        };
        tapes.give_back(taped);
        let failed = value.is_err();
        decoded.push(value.map(|(value, _)| value.unbind()));
        if failed {
            // A line that failed here may have left an array unbuilt that the tapes offer to
            // later lines: decode the rest directly, in one walk.
            let rest: Vec<_> = lines.collect();
            decoded.extend(decode_lines(py, rest.iter().map(|taped| taped.line())));
            break;
        }
    }
    decoded
}

/// Pauses CPython's cycle collector for a decode and restores its state when dropped.
///
/// A decode builds thousands of lists and dicts; the young-generation collections they
/// trigger walk token lists of up to tens of thousands of items before those lists are
/// untracked (about 5% of a freeze's decode here). The decode holds the GIL from start to end,
/// so no other Python code runs while collections are paused. If the `gc` module cannot be
/// reached, nothing is paused.
struct CollectorPause<'py> {
    gc: Option<Bound<'py, pyo3::types::PyModule>>,
}

impl<'py> CollectorPause<'py> {
    fn new(py: Python<'py>) -> Self {
        let gc = py.import("gc").ok().filter(|gc| {
            let enabled = gc
                .call_method0("isenabled")
                .and_then(|on| on.is_truthy())
                .unwrap_or(false);
            enabled && gc.call_method0("disable").is_ok()
        });
        CollectorPause { gc }
    }
}

impl Drop for CollectorPause<'_> {
    fn drop(&mut self) {
        if let Some(gc) = &self.gc {
            let _ = gc.call_method0("enable");
        }
    }
}

/// The decoded values of `records` (whose lines are a subsequence of `ranges`, which
/// `decoded` follows) and their byte offsets. A record line that did not decode is corruption.
pub(super) fn select_records<'py>(
    py: Python<'py>,
    log: &Path,
    ranges: &[Range<usize>],
    decoded: Vec<PyResult<Py<PyAny>>>,
    records: &store::Records,
) -> PyResult<DecodedRecords<'py>> {
    let mut decoded = ranges.iter().zip(decoded);
    let mut values = Vec::with_capacity(records.lines.len());
    for wanted in &records.lines {
        let Some((_, value)) = decoded.find(|(range, _)| range.start == wanted.start) else {
            let detail = "the record's line was not decoded";
            return Err(to_pyerr(
                py,
                Error::corrupt(log, wanted.start as u64, detail),
            ));
        };
        values.push(value.map_err(|err| {
            let detail = format!("the line is not a valid entry: {}", err.value(py));
            to_pyerr(py, Error::corrupt(log, wanted.start as u64, detail))
        })?);
    }
    let offsets = records.lines.iter().map(|range| range.start).collect();
    Ok((PyList::new(py, values)?, offsets))
}

/// A fetched log as Python hands it over: one `bytes` buffer of newline-terminated lines, or a
/// sequence of lines (`bytes` each, without newlines: the rows a PostgreSQL fetch returns). Both
/// are held without copying (a `bytearray` line is copied).
pub(super) enum PyFetchedLog<'py> {
    Joined(Bound<'py, PyBytes>),
    Lines(Vec<PyBackedBytes>),
}

impl<'py> FromPyObject<'_, 'py> for PyFetchedLog<'py> {
    type Error = PyErr;

    fn extract(log: Borrowed<'_, 'py, PyAny>) -> PyResult<Self> {
        if let Ok(buf) = log.cast::<PyBytes>() {
            return Ok(PyFetchedLog::Joined(buf.to_owned()));
        }
        let refused = |detail: String| {
            PyTypeError::new_err(format!(
                "log must be bytes or a sequence of bytes lines, not {}: {detail}",
                log.get_type()
                    .name()
                    .map_or_else(|_| "?".into(), |n| n.to_string())
            ))
        };
        if log.is_instance_of::<PyString>() {
            return Err(refused("a str is not a sequence of lines".into()));
        }
        log.extract::<Vec<PyBackedBytes>>()
            .map(PyFetchedLog::Lines)
            .map_err(|err| refused(err.to_string()))
    }
}

impl PyFetchedLog<'_> {
    /// `work` with the log's bytes borrowed (no copy), free of the interpreter.
    pub(super) fn detached<T: Send>(
        &self,
        py: Python<'_>,
        work: impl FnOnce(FetchedLog<'_>) -> T + Send,
    ) -> T {
        match self {
            PyFetchedLog::Joined(buf) => {
                let buf = buf.as_bytes();
                py.detach(|| work(FetchedLog::Joined(buf)))
            }
            PyFetchedLog::Lines(lines) => py.detach(|| {
                let lines: Vec<&[u8]> = lines.iter().map(|line| &**line).collect();
                work(FetchedLog::Lines(&lines))
            }),
        }
    }
}

/// A log fetched whole from another backend (complete canonical lines, joined or apart; see
/// `crate::fetched`), decoded as `Store.read_lines` decodes a log file: `(records, offsets)`, the
/// first record of each call id with the byte offset of its line (in the joined log, whichever
/// form came in). With `digests` (one per line, as stored beside it) every line is checked
/// against its digest first. A refusal is the file store's corruption error, worded as the file
/// store words it with `source` in place of the log's path. Only the building of the Python
/// objects holds the interpreter; a large log is walked into tapes and hashed on other threads
/// meanwhile.
#[pyfunction]
#[pyo3(name = "decode_lines", signature = (log, digests = None, source = "<log>"))]
pub(super) fn decode_fetched_lines<'py>(
    py: Python<'py>,
    log: PyFetchedLog<'py>,
    digests: Option<Vec<String>>,
    source: &str,
) -> PyResult<DecodedRecords<'py>> {
    let path = Path::new(source);
    let (records, ranges, decoded) = log
        .detached(py, |log| {
            log.decode(digests.as_deref(), path, decode_in_python)
        })
        .map_err(|e| to_pyerr(py, e))?;
    select_records(py, path, &ranges, decoded, &records)
}
