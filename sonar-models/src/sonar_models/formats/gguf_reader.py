"""A ``.gguf`` file's header read in one pass: metadata fields and tensor descriptions, each
tensor's data a view of the file's memory map.

``gguf.GGUFReader`` builds a numpy view for every element of every metadata array (two per
token of a vocabulary), which takes seconds for a 49k-token vocabulary and grows with it; this
reader decodes a string array in one Python loop and a numeric array as one view, so a header
reads in a fraction of that. Fields and tensors offer what the ``gguf`` package's do and Sonar
uses (``contents()``, ``types``; ``name``, ``tensor_type``, ``shape``, ``data``), with each
tensor's data shaped as ``gguf.GGUFReader`` shapes it (quantized types as rows of bytes), so
``gguf.quants.dequantize`` reads it unchanged.

A file is untrusted input: every length and offset is checked against the file's size before
it is used, and a file that does not parse raises ``ValueError`` naming what is wrong.
"""

from __future__ import annotations

import hashlib
import math
import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_ARRAY_DEPTH = 8  # arrays of arrays: llama.cpp writes none deeper than two

#: fixed-size metadata value types: (struct code, numpy type)
_SCALARS = {
    GGUFValueType.UINT8: ("B", np.uint8),
    GGUFValueType.INT8: ("b", np.int8),
    GGUFValueType.UINT16: ("H", np.uint16),
    GGUFValueType.INT16: ("h", np.int16),
    GGUFValueType.UINT32: ("I", np.uint32),
    GGUFValueType.INT32: ("i", np.int32),
    GGUFValueType.FLOAT32: ("f", np.float32),
    GGUFValueType.BOOL: ("?", np.bool_),
    GGUFValueType.UINT64: ("Q", np.uint64),
    GGUFValueType.INT64: ("q", np.int64),
    GGUFValueType.FLOAT64: ("d", np.float64),
}
#: tensor types stored as plain numbers (the others are blocks, read as bytes)
_PLAIN_TENSORS = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


@dataclass(frozen=True)
class GGUFField:
    """One metadata key's value: ``types`` as the ``gguf`` package gives them (``[ARRAY,
    element type]`` for an array), the decoded value, and where its bytes lie in the file."""

    name: str
    types: list[GGUFValueType]
    value: Any
    span: tuple[int, int]

    def contents(self) -> Any:
        """The value: a str, a number, or a list of them."""
        return self.value

    @property
    def count(self) -> int:
        """An array's element count (1 for a single value)."""
        return len(self.value) if self.types[0] == GGUFValueType.ARRAY else 1


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor: ``shape`` in the file's order (fastest dimension first), ``data`` a
    read-only view of the memory map in numpy order."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray


@dataclass
class GGUFHeader:
    """A parsed ``.gguf`` file (``read_gguf``)."""

    path: Path
    version: int
    fields: dict[str, GGUFField] = field(default_factory=dict)
    tensors: list[GGUFTensor] = field(default_factory=list)
    alignment: int = DEFAULT_ALIGNMENT
    data_offset: int = 0
    _buffer: Any = None

    def raw_bytes(self, key: str) -> bytes:
        """The bytes ``key``'s value takes in the file (for content hashes)."""
        start, end = self.fields[key].span
        return bytes(self._buffer[start:end])

    def digest(self, keys: list[str]) -> str:
        """A SHA-256 over the names and stored bytes of those of ``keys`` the file has."""
        hasher = hashlib.sha256()
        for key in keys:
            if key in self.fields:
                stored = self.raw_bytes(key)
                hasher.update(key.encode() + b"\0" + struct.pack("<Q", len(stored)) + stored)
        return hasher.hexdigest()


class _Cursor:
    """Reads values at an advancing offset, each checked against the end of the file."""

    def __init__(self, buffer: memoryview, order: str) -> None:
        self.buffer, self.order, self.offset = buffer, order, 0
        self.size = len(buffer)

    def take(self, count: int) -> int:
        start = self.offset
        if count < 0 or start + count > self.size:
            raise ValueError(f"GGUF header runs past the end of the file ({self.size} bytes) at offset {start}")
        self.offset = start + count
        return start

    def scalar(self, code: str) -> Any:
        size = struct.calcsize(code)
        return struct.unpack_from(self.order + code, self.buffer, self.take(size))[0]

    def string(self) -> str:
        length = self.scalar("Q")
        start = self.take(length)
        try:
            return str(self.buffer[start : start + length], "utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"GGUF string at offset {start} is not UTF-8") from None

    def value_type(self) -> GGUFValueType:
        raw = self.scalar("I")
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise ValueError(f"GGUF metadata value type {raw} at offset {self.offset - 4} is unknown") from None

    def value(self, kind: GGUFValueType, depth: int = 0) -> tuple[Any, list[GGUFValueType]]:
        if kind == GGUFValueType.STRING:
            return self.string(), [kind]
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind][0]), [kind]
        if depth >= MAX_ARRAY_DEPTH:
            raise ValueError(f"GGUF arrays nested more than {MAX_ARRAY_DEPTH} deep at offset {self.offset}")
        element = self.value_type()
        count = self.scalar("Q")
        if element in _SCALARS:
            code, dtype = _SCALARS[element]
            start = self.take(count * struct.calcsize(code))
            values = np.frombuffer(self.buffer, dtype=np.dtype(dtype).newbyteorder(self.order), count=count, offset=start)
            return values.tolist(), [kind, element]
        if count > (self.size - self.offset) // 8:  # every string or array takes at least 8 bytes
            raise ValueError(f"GGUF array of {count} entries runs past the end of the file")
        if element == GGUFValueType.STRING:
            return [self.string() for _ in range(count)], [kind, element]
        items, types = [], [kind, element]
        for _ in range(count):  # arrays of arrays
            item, inner = self.value(element, depth + 1)
            items.append(item)
            if len(types) == 2:
                types += inner[1:]
        return items, types


def read_gguf(path: str | Path) -> GGUFHeader:
    """Parse ``path``'s header (version 2 or 3, either byte order)."""
    path = Path(path)
    with path.open("rb") as handle:
        try:
            mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:  # an empty file cannot be mapped
            raise ValueError(f"{path} is not a GGUF file (it is empty)") from None
    buffer = memoryview(mapped)
    if bytes(buffer[:4]) != GGUF_MAGIC:
        raise ValueError(f"{path} is not a GGUF file (no GGUF magic)")
    order = "<"
    (version,) = struct.unpack_from("<I", buffer, 4) if len(buffer) >= 8 else (0,)
    if version & 0xFFFF == 0 and version:  # written on a machine of the other byte order
        order = ">"
        (version,) = struct.unpack_from(">I", buffer, 4)
    if version not in SUPPORTED_VERSIONS:
        raise ValueError(f"{path}: GGUF version {version} is not supported (supported: {list(SUPPORTED_VERSIONS)})")
    cursor = _Cursor(buffer, order)
    cursor.offset = 8
    num_tensors, num_fields = cursor.scalar("Q"), cursor.scalar("Q")
    header = GGUFHeader(path, version, _buffer=buffer)
    for _ in range(num_fields):
        key = cursor.string()
        kind = cursor.value_type()
        start = cursor.offset
        value, types = cursor.value(kind)
        if key in header.fields:
            raise ValueError(f"{path}: metadata key {key!r} appears twice")
        header.fields[key] = GGUFField(key, types, value, (start, cursor.offset))
    infos = []
    for _ in range(num_tensors):
        name = cursor.string()
        num_dims = cursor.scalar("I")
        if num_dims > 8:
            raise ValueError(f"{path}: tensor {name!r} has {num_dims} dimensions")
        dims = [cursor.scalar("Q") for _ in range(num_dims)]
        raw_type, offset = cursor.scalar("I"), cursor.scalar("Q")
        infos.append((name, dims, raw_type, offset))
    alignment = header.fields.get("general.alignment")
    if alignment is not None:
        if alignment.types != [GGUFValueType.UINT32] or alignment.value <= 0 or alignment.value & (alignment.value - 1):
            raise ValueError(f"{path}: general.alignment must be a power of two stored as uint32")
        header.alignment = alignment.value
    header.data_offset = -(-cursor.offset // header.alignment) * header.alignment
    names = set()
    for name, dims, raw_type, offset in infos:
        if name in names:
            raise ValueError(f"{path}: tensor {name!r} appears twice")
        names.add(name)
        header.tensors.append(_tensor(path, mapped, header.data_offset, name, dims, raw_type, offset, order))
    return header


def _tensor(path: Path, mapped: mmap.mmap, data_offset: int, name: str, dims: list[int], raw_type: int, offset: int, order: str) -> GGUFTensor:
    try:
        kind = GGMLQuantizationType(raw_type)
        block, type_size = GGML_QUANT_SIZES[kind]
    except (ValueError, KeyError):
        raise ValueError(f"{path}: tensor {name!r} has unknown type {raw_type}") from None
    n_elements = math.prod(dims)
    numpy_dims = tuple(reversed(dims))
    if numpy_dims and numpy_dims[-1] % block:
        raise ValueError(f"{path}: tensor {name!r} rows of {numpy_dims[-1]} are not whole blocks of {block}")
    n_bytes = n_elements // block * type_size
    start = data_offset + offset
    if start + n_bytes > len(mapped):
        raise ValueError(f"{path}: tensor {name!r} runs past the end of the file")
    plain = _PLAIN_TENSORS.get(kind)
    if plain is not None:
        dtype, count = np.dtype(plain).newbyteorder(order), n_elements
    else:
        dtype, count = np.dtype(np.uint8), n_bytes
        numpy_dims = (*numpy_dims[:-1], numpy_dims[-1] // block * type_size) if numpy_dims else (n_bytes,)
    data = np.frombuffer(mapped, dtype=dtype, count=count, offset=start).reshape(numpy_dims)
    return GGUFTensor(name, kind, np.array(dims, dtype=np.uint64), n_elements, n_bytes, start, data)
