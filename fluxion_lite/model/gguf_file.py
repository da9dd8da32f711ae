"""The GGUF container: metadata and tensor table parsed in one pass, tensor data memory-mapped.

gguf-py's reader builds a numpy view per array element, which for a 150k-token vocabulary (tokens and merges as
string arrays) takes ~12 s; this reader reads scalars and small arrays with struct and steps over the vocabulary
arrays (the tokenizer reads them through llama.cpp), so opening qwen2.5-0.5b takes well under a second.

Layout (GGUF v2 and v3, little-endian): magic "GGUF", u32 version, u64 tensor count, u64 key/value count; the
key/values (string key, u32 value type, value); the tensor infos (string name, u32 n_dims, u64 dims[n_dims] innermost
first, u32 ggml type, u64 offset from the data start); padding to general.alignment (default 32); the tensor data.
Strings are u64 length + UTF-8 bytes; arrays are u32 element type + u64 count + elements.
"""
from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# value types: struct format of the scalars (8: string, 9: array)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
# arrays of more elements than this are stepped over unless asked for (vocabularies, merges, scores)
MAX_KEPT_ARRAY = 4096
# (elements per block, bytes per block) of the ggml types (ggml.h's type traits); others: the tensor is listed but
# its size is unknown (it cannot be loaded)
BLOCKS = {0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34), 9: (32, 36),
          10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176), 14: (256, 210), 15: (256, 292),
          16: (256, 66), 17: (256, 74), 18: (256, 98), 19: (256, 50), 20: (32, 18), 21: (256, 110), 22: (256, 82),
          23: (256, 136), 24: (1, 1), 25: (1, 2), 26: (1, 4), 27: (1, 8), 28: (1, 8), 29: (256, 56), 30: (1, 2),
          34: (256, 54), 35: (256, 66), 39: (32, 17)}
TYPE_NAMES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1", 10: "Q2_K",
              11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS",
              19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32",
              27: "I64", 28: "F64", 29: "IQ1_M", 30: "BF16", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4"}
_PLAIN_DTYPES = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32, 27: np.int64, 28: np.float64}


class GGUFFormatError(ValueError):
    """The bytes are not a readable GGUF file; part says where ("header" or "tensor data")."""

    def __init__(self, part: str, reason: str):
        super().__init__(reason)
        self.part = part


@dataclass
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # innermost first, as the file lists them (ne0 = the row length)
    type_id: int
    offset: int  # absolute byte offset of the data in the file
    n_bytes: int  # -1 for a type this reader does not know the block size of
    _buf: Any

    @property
    def type_name(self) -> str:
        return TYPE_NAMES.get(self.type_id, f"type {self.type_id}")

    @property
    def shape(self) -> tuple[int, ...]:
        """Row-major (torch) order: outermost first."""
        return tuple(reversed(self.dims))

    @property
    def data(self) -> np.ndarray:
        """The tensor's bytes as a read-only view: plain types as their numpy dtype in `shape`; block types as
        uint8 [rows, row_bytes]."""
        if self.n_bytes < 0:
            raise GGUFFormatError("tensor data", f"tensor {self.name!r} has type {self.type_name}, of unknown size")
        if self.type_id in _PLAIN_DTYPES:
            return np.frombuffer(self._buf, _PLAIN_DTYPES[self.type_id], self.n_bytes // np.dtype(
                _PLAIN_DTYPES[self.type_id]).itemsize, self.offset).reshape(self.shape)
        rows = int(np.prod(self.shape[:-1])) if len(self.shape) > 1 else 1
        return np.frombuffer(self._buf, np.uint8, self.n_bytes, self.offset).reshape(rows, self.n_bytes // rows)


class _Cursor:
    def __init__(self, buf: Any, size: int):
        self.buf, self.size, self.pos = buf, size, 0

    def need(self, n: int) -> None:
        if self.pos + n > self.size:
            raise GGUFFormatError("header", f"the file ends at byte {self.size:,} inside the header (reading "
                                            f"{n} bytes at {self.pos:,})")

    def scalar(self, fmt: str) -> Any:
        n = struct.calcsize(fmt)
        self.need(n)
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return v

    def string(self) -> str:
        n = self.scalar("<Q")
        self.need(n)
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def skip_strings(self, count: int) -> None:
        buf, pos, size = self.buf, self.pos, self.size
        unpack = struct.Struct("<Q").unpack_from
        for _ in range(count):
            if pos + 8 > size:
                self.pos = pos
                self.need(8)
            pos += 8 + unpack(buf, pos)[0]
        self.pos = pos
        self.need(0)

    def value(self, vtype: int, keep: bool = True) -> Any:
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype != _ARRAY:
            raise GGUFFormatError("header", f"unknown value type {vtype} at byte {self.pos:,}")
        etype, count = self.scalar("<I"), self.scalar("<Q")
        if etype == _ARRAY:
            return [self.value(_ARRAY, keep) for _ in range(count)]
        if not keep or count > MAX_KEPT_ARRAY:
            if etype == _STRING:
                self.skip_strings(count)
            elif etype in _SCALARS:
                n = struct.calcsize(_SCALARS[etype]) * count
                self.need(n)
                self.pos += n
            else:
                raise GGUFFormatError("header", f"unknown array element type {etype}")
            return None
        return [self.value(etype) for _ in range(count)]


class GGUFFile:
    """metadata: key -> value (str, int, float, bool or list; arrays over MAX_KEPT_ARRAY elements are left out);
    tensors: the tensor table in file order, each with a memory-mapped view of its data."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        with open(self.path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if size < 4 or fh.read(4) != MAGIC:
                raise GGUFFormatError("magic", "not a GGUF file")
            self._map = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        buf = memoryview(self._map)
        c = _Cursor(buf, size)
        c.pos = 4
        self.version = c.scalar("<I")
        if self.version not in (2, 3):
            raise GGUFFormatError("header", f"GGUF version {self.version} (supported: 2, 3)")
        n_tensors, n_kv = c.scalar("<Q"), c.scalar("<Q")
        if n_tensors > size or n_kv > size:  # every entry takes bytes: counts past the size are garbage
            raise GGUFFormatError("header", f"implausible counts ({n_tensors} tensors, {n_kv} keys)")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = c.string()
            value = c.value(c.scalar("<I"))
            if value is not None:
                self.metadata[key] = value
        infos = []
        for _ in range(n_tensors):
            name = c.string()
            n_dims = c.scalar("<I")
            if n_dims > 8:
                raise GGUFFormatError("header", f"tensor {name!r} has {n_dims} dimensions")
            dims = tuple(c.scalar("<Q") for _ in range(n_dims))
            infos.append((name, dims, c.scalar("<I"), c.scalar("<Q")))
        align = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(align, int) or align <= 0:
            raise GGUFFormatError("header", f"general.alignment is {align!r}")
        data_start = (c.pos + align - 1) // align * align
        if data_start > size and infos:
            raise GGUFFormatError("header", f"the file ends at byte {size:,} before the tensor data (byte "
                                            f"{data_start:,})")
        self.data_start = data_start
        self.tensors: list[TensorInfo] = []
        for name, dims, type_id, offset in infos:
            n_bytes = -1
            if type_id in BLOCKS:
                block, nbytes = BLOCKS[type_id]
                n_el = int(np.prod(dims)) if dims else 1
                n_bytes = n_el // block * nbytes
            info = TensorInfo(name, dims, type_id, data_start + offset, n_bytes, self._map)
            if n_bytes >= 0 and info.offset + n_bytes > size:
                raise GGUFFormatError("tensor data", f"tensor {name!r} ends at byte {info.offset + n_bytes:,}, "
                                                     f"past the end of the file")
            self.tensors.append(info)


__all__ = ["GGUFFile", "GGUFFormatError", "TensorInfo", "TYPE_NAMES"]
