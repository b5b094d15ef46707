"""Attachments of a staged call: how every staging backend encodes them and gives them back.

NeMo Gym's rule: a sink stores every attachment in the same durable write as the record or
refuses the call; it never drops one. What is stored:

* ``bytes``, and the same bytes in another bytes-like type (a ``bytearray``, a ``memoryview``
  or ``array('B')``: any one-dimensional buffer of unsigned bytes, struct format ``B``, with no
  ``dtype``): as they are (kind ``"bytes"``), so a restage of equal data with another such type
  is the same call, and a fetch gives kind ``"bytes"`` back (also for a call an older build
  stored as a ``"buffer"``);
* anything exporting the buffer protocol (``bytearray``, ``memoryview``, numpy arrays, a
  tensor's numpy view): its bytes in C order with the buffer's struct ``format``, its
  ``shape`` and, when the object has a ``dtype``, its ``dtype.str`` (a structured dtype's
  ``descr``) (kind ``"buffer"``); a numpy array whose dtype has no buffer format
  (``datetime64``, ``timedelta64``) the same way, with an empty format. A buffer of Python
  object references (numpy's ``object`` dtype, format ``O``) holds no data and is refused;
* anything exporting ``__arrow_c_array__`` (pyarrow, polars, ...): the array as an Arrow IPC
  stream of one column (kind ``"arrow"``; needs pyarrow, the ``test`` extra, to encode and
  decode; without it such an attachment is refused with a message naming pyarrow).

Anything else is refused with a `TypeError` naming the attachment and its type. Fetched
attachments come back as `StagedAttachment` values.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "AttachmentKind",
    "EncodedAttachment",
    "StagedAttachment",
    "decode_attachments",
    "encode_attachments",
]

AttachmentKind = Literal["bytes", "buffer", "arrow"]
_KIND_CODES: dict[str, int] = {"bytes": 0, "buffer": 1, "arrow": 2}

# (name, kind code, format, dtype, shape or None, [buffers]): what `_core.staging_encode` reads.
EncodedAttachment = tuple[str, int, str, str, tuple[int, ...] | None, list[Any]]


@dataclass(frozen=True, slots=True)
class StagedAttachment:
    """One stored attachment: its bytes and what is known of their layout."""

    kind: AttachmentKind
    data: bytes
    format: str = ""
    dtype: str = ""
    shape: tuple[int, ...] | None = None

    def __bytes__(self) -> bytes:
        return self.data

    def to_numpy(self) -> Any:
        """The attachment as a numpy array (its dtype and shape when they were known)."""
        import numpy as np

        if self.kind == "arrow":
            return self.to_arrow().to_numpy(zero_copy_only=False)
        if self.dtype.startswith("["):  # a structured dtype, stored as its descr
            dtype = np.lib.format.descr_to_dtype(ast.literal_eval(self.dtype))
        else:
            dtype = np.dtype(self.dtype) if self.dtype else np.dtype(self.format or "B")
        array = np.frombuffer(self.data, dtype=dtype)
        return array.reshape(self.shape) if self.shape is not None else array

    def to_arrow(self) -> Any:
        """The attachment as a pyarrow array (``"arrow"`` attachments only)."""
        if self.kind != "arrow":
            raise TypeError(f"a {self.kind!r} attachment is not an Arrow array")
        pa = _pyarrow("read an Arrow attachment")
        reader = pa.ipc.open_stream(pa.py_buffer(self.data))
        table = reader.read_all()
        column = table.column(0)
        return column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)


def _pyarrow(what: str) -> Any:
    try:
        import pyarrow  # type: ignore[import-untyped]
    except ImportError as error:
        raise TypeError(
            f"to {what}, install pyarrow (pip install pyarrow, or tokencapture's 'test' extra)"
        ) from error
    return pyarrow


class _Refused(TypeError):
    """A refusal that already names its attachment and type (`_refuse`); raised as the plain
    `TypeError` it derives from everywhere else (`_encode_one`)."""


def _refuse(name: str, value: Any, why: str) -> TypeError:
    return _Refused(
        f"attachment {name!r} is a {type(value).__module__}.{type(value).__qualname__}, which "
        f"cannot be staged: {why}"
    )


def _dtype_text(name: str, value: Any) -> str:
    """What is stored of an array's dtype: ``dtype.str``, or for a structured dtype its
    ``descr`` (``dtype.str`` of a record is only ``|V<size>``, which loses the fields)."""
    dtype = getattr(value, "dtype", None)
    if dtype is None:
        return ""
    if getattr(dtype, "hasobject", False):
        raise _refuse(name, value, f"its dtype {dtype} holds Python object references, not data")
    if getattr(dtype, "fields", None) is not None:
        return repr(dtype.descr)
    return str(getattr(dtype, "str", ""))


def _holds_objects(fmt: str) -> bool:
    """Whether a buffer's struct format has an ``O`` (a PyObject pointer) item: field names
    (``:name:`` in a ``T{...}`` format) are not items."""
    return "O" in re.sub(r":[^:]*:", "", fmt)


def _encode_one(name: str, value: Any) -> EncodedAttachment:
    """Encode one attachment, or refuse it with a `TypeError` naming it and its type: also
    when what fails comes from deep inside (numpy's ``descr``, an Arrow export that raises or
    returns something else than capsules), the failure's type and words kept in the reason."""
    try:
        return _encode_value(name, value)
    except _Refused as refused:
        raise TypeError(*refused.args) from refused.__cause__
    except Exception as error:
        refusal = _refuse(name, value, f"{type(error).__name__}: {error}")
        raise TypeError(*refusal.args) from error


def _encode_value(name: str, value: Any) -> EncodedAttachment:
    if type(value) is bytes:
        return (name, _KIND_CODES["bytes"], "", "", None, [value])
    if type(value).__module__.startswith("numpy.ma") and getattr(value, "mask", None) is not None:
        # Its buffer is its data alone: staged, its mask would be dropped without a word.
        raise _refuse(
            name,
            value,
            "its buffer holds the data without the mask, which would be lost: stage "
            "value.filled(...) or the data and numpy.ma.getmaskarray(value) as two attachments",
        )
    try:
        view = memoryview(value)
    except TypeError:
        view = None
    except ValueError as error:
        # A numpy array whose dtype has no buffer format (datetime64, timedelta64): its bytes
        # in C order with its dtype and shape, as numpy gives them.
        tobytes = getattr(value, "tobytes", None)
        shape = getattr(value, "shape", None)
        if getattr(value, "dtype", None) is None or not callable(tobytes) or shape is None:
            raise _refuse(name, value, f"its buffer cannot be read ({error})") from error
        dtype_text = _dtype_text(name, value)
        return (name, _KIND_CODES["buffer"], "", dtype_text, tuple(shape), [tobytes()])
    if view is not None:
        dtype_text = _dtype_text(name, value)
        if _holds_objects(view.format):
            raise _refuse(
                name, value, f"its buffer format {view.format!r} holds Python object references"
            )
        if view.format == "B" and view.ndim == 1 and not dtype_text:
            # Plain bytes in another bytes-like type: stored as bytes are.
            data: Any = view if view.c_contiguous else view.tobytes()
            return (name, _KIND_CODES["bytes"], "", "", None, [data])
        flat: Any
        try:
            # The bytes without a copy when they are contiguous; a copy in C order otherwise.
            flat = view.cast("B") if view.c_contiguous else view.tobytes()
        except (TypeError, ValueError):
            flat = view.tobytes()
        shape = tuple(view.shape or ())
        return (name, _KIND_CODES["buffer"], view.format, dtype_text, shape, [flat])
    if hasattr(type(value), "__arrow_c_array__"):
        try:
            pa = _pyarrow(f"stage the Arrow attachment {name!r} ({type(value).__name__})")
        except TypeError as missing:  # its words name the attachment already
            raise _Refused(*missing.args) from missing.__cause__
        array = pa.array(value)
        batch = pa.RecordBatch.from_arrays([array], names=[name])
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, batch.schema) as writer:
            writer.write_batch(batch)
        return (
            name,
            _KIND_CODES["arrow"],
            str(array.type),
            "",
            (len(array),),
            [sink.getvalue().to_pybytes()],
        )
    raise _refuse(
        name,
        value,
        "attachments must be bytes, export the buffer protocol (numpy arrays, a tensor's "
        ".numpy() view) or export __arrow_c_array__",
    )


def encode_attachments(attachments: Mapping[str, Any] | None) -> list[EncodedAttachment] | None:
    """Encode every attachment (in the mapping's order, the order they are stored in; a
    restage's attachments are compared by name, so their order is not content), or refuse
    the whole call. An empty mapping is no attachments, as ``None`` is: both store the same
    call, so a restage with either is idempotent."""
    if attachments is None:
        return None
    if not isinstance(attachments, Mapping):
        raise TypeError(f"attachments must be a mapping or None, got {type(attachments).__name__}")
    encoded: list[EncodedAttachment] = []
    for name, value in attachments.items():
        if type(name) is not str:
            raise TypeError(f"attachment names must be str, got {type(name).__name__}")
        encoded.append(_encode_one(name, value))
    return encoded or None


def decode_attachments(
    decoded: list[tuple[str, str, str, str, list[int] | None, list[bytes]]],
) -> dict[str, StagedAttachment]:
    """The attachments `_core` decoded from a stored blob, by name."""
    out: dict[str, StagedAttachment] = {}
    for name, kind, fmt, dtype, shape, buffers in decoded:
        data = buffers[0] if len(buffers) == 1 else b"".join(buffers)
        out[name] = StagedAttachment(
            kind=kind,  # type: ignore[arg-type]
            data=data,
            format=fmt,
            dtype=dtype,
            shape=tuple(shape) if shape is not None else None,
        )
    return out
