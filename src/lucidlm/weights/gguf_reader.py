"""A small, fast GGUF reader: the header and metadata parsed in one pass, tensors as NumPy
views of the memory-mapped file (nothing is copied until asked).

``gguf.GGUFReader`` builds a NumPy object for every element of every metadata array, which
takes seconds for a 49k-token vocabulary and its merges; this reader decodes string arrays
in one loop and numeric arrays with one ``np.frombuffer``, so opening SmolLM2's file takes
tens of milliseconds. It offers what lucidlm uses of ``GGUFReader``: ``metadata`` (key ->
Python value) and ``tensors`` (``.name``, ``.tensor_type``, ``.shape`` in GGUF's fastest-first
order, ``.data`` shaped as ``GGUFReader`` shapes it).

File layout (GGUF v2/v3, little-endian): magic "GGUF", u32 version, u64 tensor count, u64
metadata count; metadata entries (string key, u32 type, value); tensor infos (string name,
u32 n_dims, u64 dims[n_dims], u32 type, u64 offset); padding to ``general.alignment`` (32);
tensor data. A string is a u64 length and UTF-8 bytes.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<?", 10: "<u8", 11: "<i8",
         12: "<f8"}
STRING, ARRAY = 8, 9
FLOAT_ARRAYS = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                "I32": np.int32, "I64": np.int64}


@dataclass
class Tensor:
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: np.ndarray  # GGUF order: fastest-varying dimension first
    data: np.ndarray
    data_offset: int
    n_bytes: int


class GGUFFile:
    def __init__(self, path: str | Path) -> None:
        import gguf

        self.path = Path(path)
        self.map = np.memmap(self.path, dtype=np.uint8, mode="r")
        buf = memoryview(self.map)
        self.pos = 0
        magic, version, n_tensors, n_kv = struct.unpack_from("<4sIQQ", buf, 0)
        if magic != b"GGUF" or version not in (2, 3):
            raise ValueError(f"magic {magic!r}, version {version}")
        self.pos = 24
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string(buf)
            (kind,) = self._unpack(buf, "<I")
            self.metadata[key] = self._value(buf, kind)
        infos = []
        for _ in range(n_tensors):
            name = self._string(buf)
            (n_dims,) = self._unpack(buf, "<I")
            dims = np.frombuffer(buf, dtype="<u8", count=n_dims, offset=self.pos).astype(np.int64)
            self.pos += 8 * n_dims
            kind, offset = self._unpack(buf, "<IQ")
            infos.append((name, dims, kind, offset))
        alignment = int(self.metadata.get("general.alignment", 32))
        start = self.pos + (-self.pos % alignment)
        self.tensors: list[Tensor] = []
        seen = set()
        for name, dims, kind, offset in infos:
            if name in seen:
                raise ValueError(f"duplicated tensor {name!r}")
            seen.add(name)
            try:
                qtype = gguf.GGMLQuantizationType(kind)
            except ValueError:
                raise UnknownTensorType(name, kind) from None
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
            n_elements = int(np.prod(dims))
            n_bytes = n_elements * type_size // block
            data_offset = start + int(offset)
            if data_offset + n_bytes > len(self.map):
                raise TensorOutOfBounds(name, data_offset, n_bytes, len(self.map))
            np_dims = tuple(int(d) for d in reversed(dims.tolist()))
            raw = self.map[data_offset:data_offset + n_bytes]
            if qtype.name in FLOAT_ARRAYS:
                data = raw.view(FLOAT_ARRAYS[qtype.name]).reshape(np_dims)
            else:  # one row of bytes per row of blocks, like GGUFReader
                data = raw.reshape(*np_dims[:-1], np_dims[-1] // block * type_size)
            self.tensors.append(Tensor(name, qtype, dims, data, data_offset, n_bytes))

    def release(self, tensor: Tensor) -> None:
        """Let this process's copy of ``tensor``'s pages go (the OS keeps them cached, and a
        later read maps them again). A loader calls it once it has converted a tensor, so
        the file's pages do not pile up in the resident memory beside the converted model."""
        mapped = getattr(self.map, "_mmap", None)  # the mmap.mmap behind np.memmap
        if mapped is None or not hasattr(mapped, "madvise") or not hasattr(mmap, "MADV_DONTNEED"):
            return  # no madvise (Windows): the pages go when the reader is dropped
        start = tensor.data_offset - tensor.data_offset % mmap.PAGESIZE
        stop = min(tensor.data_offset + tensor.n_bytes + (-(tensor.data_offset + tensor.n_bytes) % mmap.PAGESIZE),
                   len(self.map))
        if stop > start:
            mapped.madvise(mmap.MADV_DONTNEED, start, stop - start)

    def _unpack(self, buf: memoryview, fmt: str) -> tuple:
        values = struct.unpack_from(fmt, buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return values

    def _string(self, buf: memoryview) -> str:
        (length,) = struct.unpack_from("<Q", buf, self.pos)
        start = self.pos + 8
        self.pos = start + length
        if self.pos > len(buf):
            raise ValueError("string beyond the end of the file")
        return bytes(buf[start:self.pos]).decode("utf-8", errors="replace")

    def _value(self, buf: memoryview, kind: int) -> Any:
        if kind == STRING:
            return self._string(buf)
        if kind in SCALARS:
            return self._unpack(buf, SCALARS[kind])[0]
        if kind != ARRAY:
            raise ValueError(f"unknown metadata type {kind}")
        item, count = self._unpack(buf, "<IQ")
        if item in NUMPY:
            values = np.frombuffer(buf, dtype=NUMPY[item], count=count, offset=self.pos)
            self.pos += values.nbytes
            return values.tolist()
        if item == STRING:
            strings, pos = [], self.pos
            unpack = struct.Struct("<Q").unpack_from
            for _ in range(count):
                (length,) = unpack(buf, pos)
                strings.append(str(buf[pos + 8:pos + 8 + length], "utf-8", errors="replace"))
                pos += 8 + length
            if pos > len(buf):
                raise ValueError("string array beyond the end of the file")
            self.pos = pos
            return strings
        return [self._value(buf, item) for _ in range(count)]  # nested arrays: rare, keep it simple


class TensorOutOfBounds(ValueError):
    def __init__(self, name: str, start: int, n_bytes: int, size: int) -> None:
        super().__init__(name)
        self.name, self.start, self.n_bytes, self.size = name, start, n_bytes, size


class UnknownTensorType(ValueError):
    def __init__(self, name: str, kind: int) -> None:
        super().__init__(name)
        self.name, self.kind = name, kind
