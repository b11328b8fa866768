"""Read a GGUF model file: metadata, tensor directory, and tensors dequantized or in grouped form.

File layout (GGUF v2/v3, little-endian)::

    magic "GGUF" | u32 version | u64 n_tensors | u64 n_kv
    n_kv x      (string key, u32 value type, value)
    n_tensors x (string name, u32 n_dims, u64 ne[n_dims], u32 ggml type, u64 offset)
    padding to `general.alignment` (default 32)
    tensor data: tensor i at data_start + offset_i

Strings are a u64 byte length then UTF-8 bytes. ``ne[0]`` is the fastest-varying
dimension, so the PyTorch shape is ``ne`` reversed.

We parse the header ourselves rather than through ``gguf.GGUFReader``: that reader
builds several numpy views per array element, which takes ~9 s for Gemma 3's
262,144-entry vocabulary, while a plain cursor over the mapped bytes takes ~0.1 s.
The ``gguf`` package still supplies the type enums and block sizes.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType

from tokenmill.errors import ModelFormatError, ModelNotFoundError, UnsupportedModelError
from tokenmill.loading.dequant import SUPPORTED_TYPES, dequantize, packed_nbytes
from tokenmill.loading.gguf_groups import GroupedWeight, gguf_groups

_SUPPORTED_VERSIONS = (2, 3)
_MAX_DIMS = 4
_SCALARS: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "B",
    GGUFValueType.INT8: "b",
    GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I",
    GGUFValueType.INT32: "i",
    GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q",
    GGUFValueType.FLOAT32: "f",
    GGUFValueType.FLOAT64: "d",
    GGUFValueType.BOOL: "?",
}


class _HeaderError(Exception):
    """Raised by the cursor; GGUFFile turns it into a ModelFormatError naming the file."""


class _Cursor:
    """Sequential little-endian reader over the mapped file, bounds-checked against its end."""

    def __init__(self, buf: mmap.mmap) -> None:
        self.buf = buf
        self.pos = 0
        self.end = len(buf)

    def _take(self, n: int) -> int:
        start = self.pos
        if n < 0 or start + n > self.end:
            raise _HeaderError(f"header is truncated (needs {n} bytes at offset {start})")
        self.pos = start + n
        return start

    def scalar(self, fmt: str) -> Any:
        s = struct.Struct("<" + fmt)
        return s.unpack_from(self.buf, self._take(s.size))[0]

    def string(self) -> str:
        n = self.scalar("Q")
        start = self._take(n)
        try:
            return self.buf[start : start + n].decode("utf-8")
        except UnicodeDecodeError as e:
            raise _HeaderError(f"string at offset {start} is not valid UTF-8") from e

    def value(self, vtype: int) -> Any:
        """One metadata value of GGUF value type ``vtype``, as plain Python."""
        vtype = _value_type(vtype)
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype == GGUFValueType.ARRAY:
            return self.array()
        return self.scalar(_SCALARS[vtype])

    def array(self) -> list[Any]:
        itype, count = _value_type(self.scalar("I")), self.scalar("Q")
        if itype == GGUFValueType.STRING:
            return self._strings(count)
        if itype == GGUFValueType.ARRAY:
            return [self.array() for _ in range(count)]
        dtype = np.dtype("<" + _SCALARS[itype])
        start = self._take(count * dtype.itemsize)
        return np.frombuffer(self.buf, dtype=dtype, count=count, offset=start).tolist()

    def _strings(self, count: int) -> list[str]:
        """``count`` strings; the hot path for vocabularies, so kept to plain local operations."""
        buf, pos, end, out = self.buf, self.pos, self.end, []
        length_at = struct.Struct("<Q").unpack_from
        for _ in range(count):
            if pos + 8 > end:
                raise _HeaderError(f"header is truncated (string array at offset {pos})")
            (n,) = length_at(buf, pos)
            pos += 8
            if pos + n > end:
                raise _HeaderError(f"header is truncated (string of {n} bytes at offset {pos})")
            out.append(buf[pos : pos + n])
            pos += n
        self.pos = pos
        try:
            return [b.decode("utf-8") for b in out]
        except UnicodeDecodeError as e:
            raise _HeaderError("a string array holds invalid UTF-8") from e


def _value_type(raw: int) -> GGUFValueType:
    try:
        return GGUFValueType(raw)
    except ValueError:
        raise _HeaderError(f"unknown metadata value type {raw}") from None


@dataclass(frozen=True)
class TensorEntry:
    """One entry of the tensor directory. ``start`` is an absolute file offset."""

    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]
    start: int
    nbytes: int


class GGUFFile:
    """A memory-mapped GGUF file: parsed metadata and on-demand dequantized tensors.

    Opening parses the whole header and checks that every tensor's data lies inside
    the file, so a truncated download fails here rather than at first use.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._map = _open_map(self.path)
        try:
            self.metadata, self._tensors = self._parse()
            self._check_complete()
        except _HeaderError as e:
            self._map.close()
            raise ModelFormatError(f"{self.path}: not a valid GGUF file: {e}") from None
        except (ModelFormatError, UnsupportedModelError):
            self._map.close()
            raise

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise ModelFormatError(f"{self.path}: metadata has no string 'general.architecture'")
        return arch

    @property
    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def tensor_info(self, name: str) -> tuple[GGMLQuantizationType, tuple[int, ...]]:
        """Storage type and PyTorch-order shape of tensor ``name``."""
        entry = self._entry(name)
        return entry.qtype, entry.shape

    def raw_tensor(self, name: str) -> torch.Tensor:
        """The packed bytes of tensor ``name`` as a 1-D uint8 tensor (a copy)."""
        entry = self._entry(name)
        return self._bytes(entry).clone()

    def load_tensor(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Tensor ``name`` dequantized, in PyTorch order, converted to ``dtype``."""
        entry = self._entry(name)
        label = f"{self.path}: tensor {name!r}"
        if entry.qtype not in SUPPORTED_TYPES:
            raise UnsupportedModelError(f"{label} has unsupported quantization type {entry.qtype.name}")
        return dequantize(self._bytes(entry), entry.qtype, entry.shape, name=label).to(dtype)

    def load_grouped(self, name: str) -> GroupedWeight:
        """Tensor ``name`` (2-D, of a type in ``gguf_groups.NATIVE_TYPES``) as codes, scales and mins,
        exactly the file's weights (``gguf_groups``), in PyTorch order."""
        entry = self._entry(name)
        return gguf_groups(self._bytes(entry), entry.qtype, entry.shape, name=f"{self.path}: tensor {name!r}")

    def close(self) -> None:
        self._map.close()

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _entry(self, name: str) -> TensorEntry:
        entry = self._tensors.get(name)
        if entry is None:
            raise ModelFormatError(f"{self.path}: no tensor named {name!r}")
        return entry

    def _bytes(self, entry: TensorEntry) -> torch.Tensor:
        return torch.frombuffer(self._map, dtype=torch.uint8, count=entry.nbytes, offset=entry.start)

    def _parse(self) -> tuple[dict[str, Any], dict[str, TensorEntry]]:
        cur = _Cursor(self._map)
        n_tensors, n_kv = _read_preamble(cur)
        metadata = {}
        for _ in range(n_kv):
            key = cur.string()
            if key in metadata:
                raise _HeaderError(f"metadata key {key!r} appears twice")
            metadata[key] = cur.value(cur.scalar("I"))
        infos = [_read_tensor_info(cur) for _ in range(n_tensors)]
        data_start = _align(cur.pos, _alignment(metadata))
        return metadata, _build_directory(infos, data_start, self.path)

    def _check_complete(self) -> None:
        size = len(self._map)
        for entry in self._tensors.values():
            if entry.start + entry.nbytes > size:
                raise ModelFormatError(
                    f"{self.path}: file is truncated: tensor {entry.name!r} needs bytes up to "
                    f"{entry.start + entry.nbytes} but the file has {size}"
                )


def _open_map(path: Path) -> mmap.mmap:
    """Map the file copy-on-write (writable for torch.frombuffer, never written back)."""
    if not path.is_file():
        raise ModelNotFoundError(f"{path}: no such model file")
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            raise ModelFormatError(f"{path}: file is empty, not a GGUF file")
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)


def _read_preamble(cur: _Cursor) -> tuple[int, int]:
    magic = cur.scalar("I")
    if magic != GGUF_MAGIC:
        raise _HeaderError(f"bad magic {magic:#010x} (expected 'GGUF')")
    version = cur.scalar("I")
    if version not in _SUPPORTED_VERSIONS:
        raise _HeaderError(f"unsupported GGUF version {version} (big-endian files are not supported)")
    return cur.scalar("Q"), cur.scalar("Q")


def _read_tensor_info(cur: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
    """(name, GGUF dims ne[0..], raw ggml type, data offset) of one directory entry."""
    name = cur.string()
    n_dims = cur.scalar("I")
    if n_dims > _MAX_DIMS:
        raise _HeaderError(f"tensor {name!r} has {n_dims} dimensions (at most {_MAX_DIMS})")
    dims = tuple(cur.scalar("Q") for _ in range(n_dims))
    return name, dims, cur.scalar("I"), cur.scalar("Q")


def _alignment(metadata: dict[str, Any]) -> int:
    align = metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
    if not isinstance(align, int) or align <= 0 or align & (align - 1):
        raise _HeaderError(f"general.alignment {align!r} is not a positive power of two")
    return align


def _align(offset: int, alignment: int) -> int:
    return (offset + alignment - 1) // alignment * alignment


def _build_directory(
    infos: list[tuple[str, tuple[int, ...], int, int]], data_start: int, path: Path
) -> dict[str, TensorEntry]:
    directory: dict[str, TensorEntry] = {}
    for name, dims, raw_type, offset in infos:
        if name in directory:
            raise _HeaderError(f"tensor {name!r} appears twice")
        qtype = _ggml_type(f"{path}: tensor {name!r}", raw_type)
        shape = tuple(reversed(dims))
        try:
            nbytes = packed_nbytes(qtype, shape, name=f"tensor {name!r}")
        except ModelFormatError as e:
            raise _HeaderError(str(e)) from None
        directory[name] = TensorEntry(name, qtype, shape, data_start + offset, nbytes)
    return directory


def _ggml_type(label: str, raw_type: int) -> GGMLQuantizationType:
    try:
        qtype = GGMLQuantizationType(raw_type)
    except ValueError:
        raise UnsupportedModelError(f"{label} has unknown ggml type id {raw_type}") from None
    if qtype not in GGML_QUANT_SIZES:
        raise UnsupportedModelError(f"{label} has ggml type {qtype.name} with no known block size")
    return qtype
