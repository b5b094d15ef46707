//! The Python binding of columnar snapshots (`crate::columnar`): Arrow arrays over the
//! decoder's buffers, handed to Python through the Arrow PyCapsule interface
//! (`__arrow_c_stream__`, `__arrow_c_array__`, `__arrow_c_schema__`), so pyarrow, polars or
//! DuckDB import them without a copy and this package depends on none of them.
//!
//! A capsule holds arrow-rs's C structures (`FFI_ArrowArrayStream`, `FFI_ArrowArray`,
//! `FFI_ArrowSchema`) by value, first in PyO3's capsule contents, so the capsule's pointer is
//! the structure's address as the interface requires. A consumer moves the structure out
//! (copying it and marking the original released); if none does, dropping the capsule drops
//! the structure, whose `Drop` calls its release callback. No `unsafe` is needed here.
//!
//! Both classes pickle (`__reduce__`) as their record batch written as an Arrow IPC stream:
//! the same buffers, copied once into a `bytes` with the GIL released. The constructors that
//! read it back (`columnar_entries_from_ipc`, `columnar_array_from_ipc`) take only a stream of
//! exactly one batch with exactly the class's schema, fully validated; anything else is a
//! `ValueError` naming what is wrong.

use std::ffi::CString;
use std::sync::Arc;

use arrow_array::cast::AsArray;
use arrow_array::ffi::{FFI_ArrowArray, FFI_ArrowSchema};
use arrow_array::ffi_stream::FFI_ArrowArrayStream;
use arrow_array::types::Int64Type;
use arrow_array::{
    Array, ArrayRef, BooleanArray, Float64Array, Int64Array, ListArray, ListViewArray, RecordBatch,
    RecordBatchIterator, StringArray, StructArray,
};
use arrow_buffer::{OffsetBuffer, ScalarBuffer};
use arrow_schema::{ArrowError, DataType, Field, FieldRef, Schema, SchemaRef};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::pybacked::PyBackedBytes;
use pyo3::types::{PyBytes, PyCapsule, PyString, PyTuple};

use super::errors::{text, to_pyerr};
use super::store::PyStore;
use crate::columnar::{self, ColumnsError, Entries, ListColumn, Row};

pyo3::create_exception!(
    tokencapture._core,
    ColumnarRecordError,
    PyValueError,
    "A record the columnar decoder refused: args are (byte offset, message)."
);

fn arrow_err(err: ArrowError) -> PyErr {
    PyRuntimeError::new_err(format!("building Arrow arrays failed: {err}"))
}

fn record_err(err: columnar::RecordError) -> PyErr {
    ColumnarRecordError::new_err((err.offset, err.message))
}

fn columns_err(py: Python<'_>, err: ColumnsError) -> PyErr {
    match err {
        ColumnsError::Store(err) => to_pyerr(py, err),
        ColumnsError::Record(err) => record_err(err),
    }
}

fn list_type(item: DataType) -> DataType {
    DataType::List(Arc::new(Field::new("item", item, false)))
}

/// The shared-prefix prompt column's type (see `list_array`).
fn list_view_type(item: DataType) -> DataType {
    DataType::ListView(Arc::new(Field::new("item", item, false)))
}

/// The field of the array `cumulative_tokens` returns.
fn cumulative_field() -> FieldRef {
    Arc::new(Field::new(
        "cumulative_token_ids",
        list_type(DataType::Int64),
        false,
    ))
}

/// The schema of every columnar snapshot: `TokenEntry`'s fields in its order, then `extras`;
/// `prompt` is the prompt column's type (`list<int64>`, or `list_view<int64>` when shared).
fn schema(prompt: DataType) -> SchemaRef {
    use DataType::{Boolean, Float64, Int64, Utf8};
    let field =
        |name: &str, data_type: DataType, nullable: bool| Field::new(name, data_type, nullable);
    Arc::new(Schema::new(vec![
        field("schema_version", Int64, false),
        field("rollout_id", Utf8, false),
        field("model_call_id", Utf8, false),
        field("model", Utf8, false),
        field("prompt_token_ids", prompt, false),
        field("generation_token_ids", list_type(Int64), false),
        field("generation_log_probs", list_type(Float64), false),
        field("routed_experts", Utf8, true),
        field("output_items", Utf8, false),
        field("token_item_index", Int64, true),
        field("response_id", Utf8, true),
        field("created_at", Float64, false),
        field("parent_call_id", Utf8, true),
        field("cum_len", Int64, true),
        field("digest", Utf8, true),
        field("parent_resolution", Utf8, true),
        field("continuation_fingerprint", Utf8, false),
        field("continuation_context_len", Int64, false),
        field("continuation_context_digest", Utf8, false),
        field("parent_resolution_reason", Utf8, false),
        field("fingerprint_version", Int64, true),
        field("prompt_is_delta", Boolean, false),
        field("prefix_requested", Boolean, false),
        field("prefix_supplied", Boolean, false),
        field("extras", Utf8, true),
    ]))
}

/// An `int64` array over `values` (moved, not copied).
fn int64_array(values: ScalarBuffer<i64>) -> ArrayRef {
    Arc::new(Int64Array::new(values, None))
}

/// A list (or list view, when the column has sizes) array over `column`'s buffers (moved,
/// not copied).
fn list_array<T: arrow_buffer::ArrowNativeType>(
    column: ListColumn<T>,
    values: impl FnOnce(ScalarBuffer<T>) -> ArrayRef,
    item: DataType,
) -> Result<ArrayRef, ArrowError> {
    let field = Arc::new(Field::new("item", item, false));
    let offsets = ScalarBuffer::from(column.offsets);
    let values = values(ScalarBuffer::from(column.values));
    Ok(match column.sizes {
        Some(sizes) => Arc::new(ListViewArray::try_new(
            field,
            offsets,
            ScalarBuffer::from(sizes),
            values,
            None,
        )?),
        None => Arc::new(ListArray::try_new(
            field,
            OffsetBuffer::new(offsets),
            values,
            None,
        )?),
    })
}

fn batch_of(entries: Entries) -> Result<RecordBatch, ArrowError> {
    let Entries {
        rows,
        prompt_token_ids,
        generation_token_ids,
        generation_log_probs,
    } = entries;
    let text = |get: fn(&Row) -> &str| -> ArrayRef {
        Arc::new(StringArray::from_iter_values(rows.iter().map(get)))
    };
    let optional_text = |get: fn(&Row) -> Option<&str>| -> ArrayRef {
        Arc::new(rows.iter().map(get).collect::<StringArray>())
    };
    let int = |get: fn(&Row) -> Option<i64>| -> ArrayRef {
        Arc::new(rows.iter().map(get).collect::<Int64Array>())
    };
    let flag = |get: fn(&Row) -> bool| -> ArrayRef {
        Arc::new(BooleanArray::from(rows.iter().map(get).collect::<Vec<_>>()))
    };
    let prompt = list_array(prompt_token_ids, int64_array, DataType::Int64)?;
    let prompt_type = prompt.data_type().clone();
    let columns: Vec<ArrayRef> = vec![
        int(|row| Some(row.schema_version)),
        text(|row| &row.rollout_id),
        text(|row| &row.model_call_id),
        text(|row| &row.model),
        prompt,
        list_array(generation_token_ids, int64_array, DataType::Int64)?,
        list_array(
            generation_log_probs,
            |values| Arc::new(Float64Array::new(values, None)),
            DataType::Float64,
        )?,
        optional_text(|row| row.routed_experts.as_deref()),
        text(|row| &row.output_items),
        int(|row| row.token_item_index),
        optional_text(|row| row.response_id.as_deref()),
        Arc::new(Float64Array::from_iter_values(
            rows.iter().map(|row| row.created_at),
        )),
        optional_text(|row| row.parent_call_id.as_deref()),
        int(|row| row.cum_len),
        optional_text(|row| row.digest.as_deref()),
        optional_text(|row| row.parent_resolution.as_deref()),
        text(|row| &row.continuation_fingerprint),
        int(|row| Some(row.continuation_context_len)),
        text(|row| &row.continuation_context_digest),
        text(|row| &row.parent_resolution_reason),
        int(|row| row.fingerprint_version),
        flag(|row| row.prompt_is_delta),
        flag(|row| row.prefix_requested),
        flag(|row| row.prefix_supplied),
        optional_text(|row| row.extras.as_deref()),
    ];
    RecordBatch::try_new(schema(prompt_type), columns)
}

fn capsule<'py, T: 'static + Send>(
    py: Python<'py>,
    value: T,
    name: &std::ffi::CStr,
) -> PyResult<Bound<'py, PyCapsule>> {
    PyCapsule::new(py, value, Some(CString::from(name)))
}

/// A schema (or field) as an `arrow_schema` capsule.
fn schema_capsule<'py, S>(py: Python<'py>, schema: S) -> PyResult<Bound<'py, PyCapsule>>
where
    FFI_ArrowSchema: TryFrom<S, Error = ArrowError>,
{
    let schema = FFI_ArrowSchema::try_from(schema).map_err(arrow_err)?;
    capsule(py, schema, c"arrow_schema")
}

/// The entries of a columnar snapshot: one Arrow record batch, one row per entry in commit
/// order. `requested_schema` is accepted and ignored, as the interface allows: the schema is
/// fixed.
#[pyclass(frozen, name = "ColumnarEntries", module = "tokencapture._core")]
pub(super) struct ColumnarEntries {
    batch: RecordBatch,
}

#[pymethods]
impl ColumnarEntries {
    #[getter]
    fn num_rows(&self) -> usize {
        self.batch.num_rows()
    }

    fn __len__(&self) -> usize {
        self.batch.num_rows()
    }

    /// The column names, in order.
    #[getter]
    fn column_names(&self) -> Vec<String> {
        let schema = self.batch.schema();
        schema.fields().iter().map(|f| f.name().clone()).collect()
    }

    #[pyo3(signature = (requested_schema = None))]
    fn __arrow_c_stream__<'py>(
        &self,
        py: Python<'py>,
        requested_schema: Option<Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyCapsule>> {
        let _ = requested_schema;
        let batches = vec![Ok(self.batch.clone())]; // shares the buffers
        let reader = RecordBatchIterator::new(batches, self.batch.schema());
        capsule(
            py,
            FFI_ArrowArrayStream::new(Box::new(reader)),
            c"arrow_array_stream",
        )
    }

    #[pyo3(signature = (requested_schema = None))]
    fn __arrow_c_array__<'py>(
        &self,
        py: Python<'py>,
        requested_schema: Option<Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyTuple>> {
        let _ = requested_schema;
        let schema = schema_capsule(py, self.batch.schema().as_ref())?;
        let data = StructArray::from(self.batch.clone()).into_data();
        let array = capsule(py, FFI_ArrowArray::new(&data), c"arrow_array")?;
        PyTuple::new(py, [schema.into_any(), array.into_any()])
    }

    fn __arrow_c_schema__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyCapsule>> {
        schema_capsule(py, self.batch.schema().as_ref())
    }

    /// Per entry, prompt then generation, a delta entry's prompt preceded by its parent's
    /// sequence (through the chain within this snapshot): a `list<int64>` array.
    fn cumulative_tokens(&self, py: Python<'_>) -> PyResult<ColumnarArray> {
        let batch = &self.batch;
        let list = |name: &str| -> columnar::ListParts<'_, i64> {
            let column = batch.column_by_name(name).expect("fixed schema");
            match column.data_type() {
                DataType::ListView(_) => {
                    let view = column.as_list_view::<i32>();
                    let values = view.values().as_primitive::<Int64Type>().values();
                    (&values[..], view.value_offsets(), Some(view.value_sizes()))
                }
                _ => {
                    let list = column.as_list::<i32>();
                    let values = list.values().as_primitive::<Int64Type>().values();
                    (&values[..], list.offsets().inner().as_ref(), None)
                }
            }
        };
        let strings = |name: &str| {
            batch
                .column_by_name(name)
                .map(|column| column.as_string::<i32>())
                .expect("fixed schema")
        };
        let prompt = list("prompt_token_ids");
        let generation = list("generation_token_ids");
        let call_ids = strings("model_call_id");
        let parents = strings("parent_call_id");
        let delta = batch
            .column_by_name("prompt_is_delta")
            .map(|column| column.as_boolean())
            .expect("fixed schema");
        let links: Vec<columnar::Link<'_>> = (0..batch.num_rows())
            .map(|at| columnar::Link {
                call_id: call_ids.value(at),
                parent_call_id: parents.is_valid(at).then(|| parents.value(at)),
                prompt_is_delta: delta.value(at),
            })
            .collect();
        let cumulative = py
            .detach(|| columnar::cumulative_tokens(&links, prompt, generation))
            .map_err(PyValueError::new_err)?;
        let array = list_array(cumulative, int64_array, DataType::Int64).map_err(arrow_err)?;
        Ok(ColumnarArray {
            field: cumulative_field(),
            array,
        })
    }

    /// Pickle as `columnar_entries_from_ipc(<the batch as an Arrow IPC stream>)`.
    fn __reduce__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        let data = ipc_bytes(py, &self.batch)?;
        let constructor = py
            .import("tokencapture._core")?
            .getattr("columnar_entries_from_ipc")?;
        PyTuple::new(py, [constructor, PyTuple::new(py, [data])?.into_any()])
    }
}

/// One Arrow array with the `__arrow_c_array__` interface.
#[pyclass(frozen, name = "ColumnarArray", module = "tokencapture._core")]
pub(super) struct ColumnarArray {
    field: FieldRef,
    array: ArrayRef,
}

#[pymethods]
impl ColumnarArray {
    fn __len__(&self) -> usize {
        self.array.len()
    }

    #[pyo3(signature = (requested_schema = None))]
    fn __arrow_c_array__<'py>(
        &self,
        py: Python<'py>,
        requested_schema: Option<Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyTuple>> {
        let _ = requested_schema;
        let schema = schema_capsule(py, self.field.as_ref())?;
        let array = capsule(
            py,
            FFI_ArrowArray::new(&self.array.to_data()),
            c"arrow_array",
        )?;
        PyTuple::new(py, [schema.into_any(), array.into_any()])
    }

    fn __arrow_c_schema__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyCapsule>> {
        schema_capsule(py, self.field.as_ref())
    }

    /// Pickle as `columnar_array_from_ipc(<the array as a one-column Arrow IPC stream>)`.
    fn __reduce__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        let schema = Arc::new(Schema::new(vec![self.field.clone()]));
        let batch = RecordBatch::try_new(schema, vec![self.array.clone()]).map_err(arrow_err)?;
        let data = ipc_bytes(py, &batch)?;
        let constructor = py
            .import("tokencapture._core")?
            .getattr("columnar_array_from_ipc")?;
        PyTuple::new(py, [constructor, PyTuple::new(py, [data])?.into_any()])
    }
}

/// `batch` as an Arrow IPC stream (its schema, the batch, the end-of-stream marker) in a new
/// `bytes`. The encoder hands back the batch's own buffers (no copy) between the messages it
/// writes; they are copied once, straight into the `bytes`, with the GIL released.
fn ipc_bytes<'py>(py: Python<'py>, batch: &RecordBatch) -> PyResult<Bound<'py, PyBytes>> {
    let parts = py
        .detach(|| -> Result<Vec<arrow_buffer::Buffer>, ArrowError> {
            let mut encoder = arrow_ipc::writer::StreamEncoder::try_new(batch.schema_ref())?;
            let mut parts = encoder.encode(batch)?;
            parts.extend(encoder.finish()?);
            Ok(parts)
        })
        .map_err(|err| PyRuntimeError::new_err(format!("writing the Arrow IPC stream: {err}")))?;
    let len = parts.iter().map(|part| part.len()).sum();
    PyBytes::new_with(py, len, |out| {
        py.detach(|| {
            let mut at = 0;
            for part in &parts {
                out[at..at + part.len()].copy_from_slice(part);
                at += part.len();
            }
        });
        Ok(())
    })
}

/// The end-of-stream marker: the continuation marker and a zero length (or, before Arrow
/// 0.15's format, a zero length alone).
const IPC_END: [u8; 8] = [0xff, 0xff, 0xff, 0xff, 0, 0, 0, 0];
const IPC_LEGACY_END: [u8; 4] = [0; 4];

/// What `from_ipc` refuses: a message for the `ValueError`.
type Refusal = String;

/// The one record batch of an Arrow IPC stream (`data`, copied once into an aligned buffer the
/// batch's arrays then share), fully validated (offsets, UTF-8, nulls of non-null fields), the
/// stream ending right after it with the end-of-stream marker. `what` names the object for
/// the messages.
fn read_ipc_batch(
    data: &[u8],
    what: &str,
    check: impl Fn(&Schema) -> Result<(), Refusal>,
) -> Result<RecordBatch, Refusal> {
    let refused = |why: String| format!("not a pickled {what}: {why}");
    // The schema is checked before any batch is decoded with it, so the decoder only ever
    // builds arrays of the types expected here, over buffers checked to fit them.
    check_ipc_messages(data, &check).map_err(refused)?;
    let mut buffer = arrow_buffer::Buffer::from_slice_ref(data);
    let mut decoder = arrow_ipc::reader::StreamDecoder::new();
    // The decoder refuses malformed input with errors; a panic deep in it on some input
    // nobody foresaw must still reach Python as this ValueError, never as a crash.
    let decoded =
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| decoder.decode(&mut buffer)))
            .map_err(|_| refused("the Arrow IPC reader failed on it".to_owned()))?;
    let batch = match decoded {
        Ok(Some(batch)) => batch,
        Ok(None) if data.is_empty() => return Err(refused("it is empty".to_owned())),
        Ok(None) => {
            let inside = decoder.finish().is_err();
            let at = match (decoder.schema().is_some(), inside) {
                (false, true) => "inside its first message",
                (false, false) => "before any schema message",
                (true, true) => "after its schema, inside its record batch",
                (true, false) => "after its schema, before any record batch",
            };
            return Err(refused(format!(
                "the Arrow IPC stream ({} bytes) ends {at} (truncated, or not Arrow IPC?)",
                data.len()
            )));
        }
        Err(err) => {
            return Err(refused(format!(
                "it is not a valid Arrow IPC stream: {err}"
            )))
        }
    };
    let rest: &[u8] = &buffer;
    if rest != IPC_END && rest != IPC_LEGACY_END {
        let why = if rest.is_empty() || IPC_END.starts_with(rest) {
            "the Arrow IPC stream ends after its record batch without the end-of-stream marker \
             (truncated?)"
                .to_owned()
        } else {
            format!(
                "{} bytes follow its record batch where only the end-of-stream marker belongs \
                 (a second batch, or bytes that are not part of the stream)",
                rest.len()
            )
        };
        return Err(refused(why));
    }
    check(&batch.schema()).map_err(refused)?;
    check_list_items(&batch).map_err(refused)?;
    Ok(batch)
}

/// Checks the messages of the Arrow IPC stream `data` before arrow-ipc's decoder reads them:
/// the schema message's schema passes `check`, and every record batch places its buffers
/// inside its body, 8-byte aligned as the format requires, each a whole number of its items
/// (see `buffer_widths`). The decoder slices buffers unchecked and its validation views them
/// as typed slices, so such damage would panic there. Framing that runs past the end, or a
/// message that does not parse, is left to the decoder, which reports it.
fn check_ipc_messages(
    data: &[u8],
    check: &dyn Fn(&Schema) -> Result<(), Refusal>,
) -> Result<(), Refusal> {
    let word = |at: usize| -> Option<u32> {
        let bytes = data.get(at..at.checked_add(4)?)?;
        Some(u32::from_le_bytes(bytes.try_into().ok()?))
    };
    let mut widths: Option<Vec<usize>> = None;
    let mut at = 0;
    for index in 0.. {
        let Some(first) = word(at) else { break };
        let (len, header) = if first == u32::MAX {
            match word(at + 4) {
                Some(len) => (len as usize, 8),
                None => break,
            }
        } else {
            (first as usize, 4)
        };
        if len == 0 {
            break;
        }
        let start = at + header;
        let Some(metadata) = start.checked_add(len).and_then(|end| data.get(start..end)) else {
            break;
        };
        let Ok(message) = arrow_ipc::root_as_message(metadata) else {
            break;
        };
        let body = u64::try_from(message.bodyLength()).map_err(|_| {
            format!("message {index} of the Arrow IPC stream declares a negative body length")
        })?;
        if let Some(schema) = message.header_as_schema() {
            if widths.is_none() {
                let schema = arrow_ipc::convert::try_fb_to_schema(schema)
                    .map_err(|err| format!("it is not a valid Arrow IPC stream: {err}"))?;
                check(&schema)?;
                widths = Some(buffer_widths(&schema));
            }
        }
        if let Some(batch) = message.header_as_record_batch() {
            // A batch before any schema: the decoder refuses it ("Missing schema").
            let Some(widths) = &widths else { break };
            if (start + len) % 8 != 0 {
                return Err(format!(
                    "the body of its record batch starts at byte {}, not 8-byte aligned: not a \
                     valid Arrow IPC stream",
                    start + len
                ));
            }
            if batch.compression().is_some() {
                return Err("its record batch is compressed (a pickle's never is)".to_owned());
            }
            for (number, buffer) in batch.buffers().into_iter().flatten().enumerate() {
                let (offset, length) = (buffer.offset(), buffer.length());
                let inside = u64::try_from(offset).ok().zip(u64::try_from(length).ok());
                let width = widths.get(number).map_or(1, |&width| width as u64);
                let fits = inside.is_some_and(|(offset, length)| {
                    offset % 8 == 0
                        && length % width == 0
                        && offset.checked_add(length).is_some_and(|end| end <= body)
                });
                if !fits {
                    return Err(format!(
                        "buffer {number} of its record batch (offset {offset}, length {length}) \
                         is not a whole, aligned part of the batch's {body}-byte body: not a \
                         valid Arrow IPC stream"
                    ));
                }
            }
        }
        let Some(next) = usize::try_from(body)
            .ok()
            .and_then(|body| (start + len).checked_add(body))
        else {
            break;
        };
        at = next;
    }
    Ok(())
}

/// The byte width of the items of each buffer of a record batch of `schema`, in IPC order
/// (each field's validity bitmap and own buffers, then its child's), for the types a
/// snapshot has.
fn buffer_widths(schema: &Schema) -> Vec<usize> {
    fn push(data_type: &DataType, out: &mut Vec<usize>) {
        out.push(1); // the validity bitmap
        match data_type {
            DataType::Int64 | DataType::Float64 => out.push(8),
            DataType::Boolean => out.push(1),
            DataType::Utf8 => out.extend([4, 1]),
            DataType::List(item) => {
                out.push(4);
                push(item.data_type(), out);
            }
            DataType::ListView(item) => {
                out.extend([4, 4]);
                push(item.data_type(), out);
            }
            _ => {} // no snapshot has it: refused by the schema check first
        }
    }
    let mut out = Vec::new();
    for field in schema.fields() {
        push(field.data_type(), &mut out);
    }
    out
}

/// `got` is exactly `expected` (names, types, nullability, no metadata), or the first
/// difference.
fn check_schema(got: &Schema, expected: &Schema) -> Result<(), Refusal> {
    let describe = |field: &Field| {
        let null = if field.is_nullable() {
            "nullable"
        } else {
            "non-null"
        };
        format!("{:?} ({null} {})", field.name(), field.data_type())
    };
    for (at, (got, expected)) in got.fields().iter().zip(expected.fields()).enumerate() {
        if got != expected {
            return Err(format!(
                "column {at} is {} where it should be {}",
                describe(got),
                describe(expected)
            ));
        }
    }
    if got.fields().len() != expected.fields().len() {
        return Err(format!(
            "it has {} columns where there should be {}",
            got.fields().len(),
            expected.fields().len()
        ));
    }
    if !got.metadata().is_empty() {
        return Err(format!(
            "its schema has metadata (keys {:?}) where there should be none",
            got.metadata().keys().collect::<Vec<_>>()
        ));
    }
    Ok(())
}

/// No list column holds a null item (the schema says its items are non-null; Arrow's
/// validation checks that for lists but not for list views).
fn check_list_items(batch: &RecordBatch) -> Result<(), Refusal> {
    for (field, column) in batch.schema().fields().iter().zip(batch.columns()) {
        let values = match column.data_type() {
            DataType::List(_) => column.as_list::<i32>().values(),
            DataType::ListView(_) => column.as_list_view::<i32>().values(),
            _ => continue,
        };
        if values.null_count() > 0 {
            return Err(format!(
                "column {:?} has null items where its items are non-null",
                field.name()
            ));
        }
    }
    Ok(())
}

fn refusal(err: Refusal) -> PyErr {
    PyValueError::new_err(err)
}

/// The `ColumnarEntries` that `ColumnarEntries.__reduce__` wrote: an Arrow IPC stream of one
/// record batch with exactly a snapshot's schema (either prompt layout). Anything else
/// raises `ValueError` naming what is wrong.
#[pyfunction]
fn columnar_entries_from_ipc(py: Python<'_>, data: PyBackedBytes) -> PyResult<ColumnarEntries> {
    const WHAT: &str = "ColumnarEntries";
    let batch = py
        .detach(|| {
            read_ipc_batch(&data, WHAT, |got| {
                // Either prompt layout; every other column as every snapshot has it.
                let prompt = match got.fields().get(4).map(|f| f.data_type()) {
                    Some(DataType::ListView(_)) => list_view_type(DataType::Int64),
                    _ => list_type(DataType::Int64),
                };
                check_schema(got, &schema(prompt))
            })
        })
        .map_err(refusal)?;
    Ok(ColumnarEntries { batch })
}

/// The `ColumnarArray` that `ColumnarArray.__reduce__` wrote: an Arrow IPC stream of one
/// record batch whose one column is `cumulative_tokens`'s. Anything else raises `ValueError`
/// naming what is wrong.
#[pyfunction]
fn columnar_array_from_ipc(py: Python<'_>, data: PyBackedBytes) -> PyResult<ColumnarArray> {
    const WHAT: &str = "ColumnarArray";
    let field = cumulative_field();
    let batch = py
        .detach(|| {
            let expected = Schema::new(vec![field.clone()]);
            read_ipc_batch(&data, WHAT, |got| check_schema(got, &expected))
        })
        .map_err(refusal)?;
    Ok(ColumnarArray {
        field,
        array: batch.column(0).clone(),
    })
}

/// The entries of a batch `batch_of` built (detached, as each caller builds it).
fn entries_of(batch: Result<RecordBatch, ArrowError>) -> PyResult<ColumnarEntries> {
    Ok(ColumnarEntries {
        batch: batch.map_err(arrow_err)?,
    })
}

/// Freeze a rollout as `Store.freeze` does and return `(entries, incomplete, snapshot_id,
/// version)`, the entries as columns. A record freeze would refuse (or one the columns cannot
/// hold) raises `ColumnarRecordError` after the freeze is durable, as freeze raises then.
/// With `shared_prefixes`, the prompt column is a `list_view<int64>` sharing repeated
/// prompt prefixes (see `columnar::freeze_columns`).
#[pyfunction]
#[pyo3(signature = (store, rollout_id, shared_prefixes = false))]
fn freeze_columns(
    py: Python<'_>,
    store: &Bound<'_, PyStore>,
    rollout_id: &Bound<'_, PyString>,
    shared_prefixes: bool,
) -> PyResult<(ColumnarEntries, bool, String, u64)> {
    let rollout_id = text(rollout_id, "rollout_id")?;
    let store = &store.get().store(py)?;
    let frozen = py.detach(|| {
        columnar::freeze_columns(store, rollout_id, shared_prefixes).map(|snapshot| {
            let batch = batch_of(snapshot.entries);
            (
                batch,
                snapshot.incomplete,
                snapshot.snapshot_id,
                snapshot.version,
            )
        })
    });
    let (batch, incomplete, snapshot_id, version) = frozen.map_err(|e| columns_err(py, e))?;
    Ok((entries_of(batch)?, incomplete, snapshot_id, version))
}

/// The stored entries of a rollout as columns, as `Store.read_lines` reads them.
#[pyfunction]
#[pyo3(signature = (store, rollout_id, shared_prefixes = false))]
fn read_columns(
    py: Python<'_>,
    store: &Bound<'_, PyStore>,
    rollout_id: &Bound<'_, PyString>,
    shared_prefixes: bool,
) -> PyResult<ColumnarEntries> {
    let rollout_id = text(rollout_id, "rollout_id")?;
    let store = &store.get().store(py)?;
    let batch = py
        .detach(|| columnar::read_columns(store, rollout_id, shared_prefixes).map(batch_of))
        .map_err(|e| columns_err(py, e))?;
    entries_of(batch)
}

/// Stored lines that are all records (see `columnar::columns_of_lines`) as columns; a refused
/// line raises `ColumnarRecordError((index, message))`.
#[pyfunction]
fn columns_of_lines(
    py: Python<'_>,
    lines: Vec<pyo3::pybacked::PyBackedBytes>,
) -> PyResult<ColumnarEntries> {
    let batch = py.detach(|| {
        let lines: Vec<&[u8]> = lines.iter().map(|line| &**line).collect();
        columnar::columns_of_lines(&lines).map(batch_of)
    });
    entries_of(batch.map_err(record_err)?)
}

/// A log fetched whole from another backend (see `crate::fetched`; one buffer or its lines
/// apart) as columns, checked as `decode_lines` checks it (a refusal is the file store's
/// corruption error naming `source`); a record that is not a valid entry raises
/// `ColumnarRecordError((byte offset, message))`, the offset in the joined log.
/// `shared_prefixes` as for `freeze_columns`.
#[pyfunction]
#[pyo3(signature = (log, digests = None, source = "<log>", shared_prefixes = false))]
fn columns_of_log<'py>(
    py: Python<'py>,
    log: super::decode::PyFetchedLog<'py>,
    digests: Option<Vec<String>>,
    source: &str,
    shared_prefixes: bool,
) -> PyResult<ColumnarEntries> {
    let path = std::path::Path::new(source);
    let batch = log
        .detached(py, |log| {
            columnar::columns_of_log(log, digests.as_deref(), path, shared_prefixes).map(batch_of)
        })
        .map_err(|e| columns_err(py, e))?;
    entries_of(batch)
}

pub(super) fn register(module: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = module.py();
    module.add_class::<ColumnarEntries>()?;
    module.add_class::<ColumnarArray>()?;
    module.add("ColumnarRecordError", py.get_type::<ColumnarRecordError>())?;
    module.add_function(wrap_pyfunction!(freeze_columns, module)?)?;
    module.add_function(wrap_pyfunction!(read_columns, module)?)?;
    module.add_function(wrap_pyfunction!(columns_of_lines, module)?)?;
    module.add_function(wrap_pyfunction!(columns_of_log, module)?)?;
    module.add_function(wrap_pyfunction!(columnar_entries_from_ipc, module)?)?;
    module.add_function(wrap_pyfunction!(columnar_array_from_ipc, module)?)?;
    Ok(())
}
