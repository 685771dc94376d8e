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

Every count and length in the header is checked against the bytes that are left before it is
used, and every string must be UTF-8, so a truncated or corrupted file is refused with a
``GGUFFormatError`` naming the metadata key or tensor (never a struct or decode error, and
never a loop over a count of 2**64).
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lucidlm.weights import gguf_header_cache as header_cache
from lucidlm.weights.ggml_types import ggml_type, quant_sizes

SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<?", 10: "<u8", 11: "<i8",
         12: "<f8"}
STRING, ARRAY = 8, 9
FLOAT_ARRAYS = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                "I32": np.int32, "I64": np.int64}
VERSIONS = (2, 3)
MAX_DIMS = 4             # GGML_MAX_DIMS
MAX_ARRAY_NESTING = 4    # arrays of arrays: real files use none


@dataclass
class Tensor:
    name: str
    tensor_type: Any  # ggml_types.GGMLType (or gguf.GGMLQuantizationType for a type newer than it)
    shape: np.ndarray  # GGUF order: fastest-varying dimension first
    data: np.ndarray
    data_offset: int
    n_bytes: int


class GGUFFile:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.map = np.memmap(self.path, dtype=np.uint8, mode="r")
        buf = memoryview(self.map)
        self.size = len(buf)
        self.pos, self.where = 0, "the header"
        entry = header_cache.lookup(self.path, buf)  # these very header bytes, parsed earlier in this process
        if entry is None:
            infos = self._parse_header(buf)
            entry = header_cache.store(self.path, buf, self.pos, self.metadata, infos)
        self.metadata = dict(entry.metadata)  # a caller's own dict (the values are never mutated)
        infos, self.pos, self.header_digest = entry.infos, entry.header_len, entry.digest
        alignment = self.metadata.get("general.alignment", 32)
        if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0 or \
                alignment & (alignment - 1) or alignment > 1 << 20:
            raise GGUFFormatError(f"general.alignment is {alignment!r}; expected a power of two (32 by default)")
        start = self.pos + (-self.pos % alignment)
        self.tensors: list[Tensor] = []
        seen = set()
        # Views of a plain ndarray over the map: slicing np.memmap itself runs its Python
        # __array_finalize__ (an overlap test) for every view, ~0.1 s over SmolLM2's tensors.
        plain = self.map.view(np.ndarray)
        for name, dims, kind, offset in infos:
            if name in seen:
                raise GGUFFormatError(f"tensor {name!r} appears twice")
            seen.add(name)
            try:
                qtype = ggml_type(kind)
            except ValueError:
                raise UnknownTensorType(name, kind) from None
            block, type_size = quant_sizes(qtype)
            if min(dims) < 1 or dims[0] % block:
                raise GGUFFormatError(f"tensor {name!r} has dimensions {dims}; each must be >= 1 and the first a "
                                      f"multiple of {block} for type {qtype.name}")
            n_elements = math.prod(dims)  # Python ints: no overflow on absurd dimensions
            n_bytes = n_elements * type_size // block
            data_offset = start + offset
            if data_offset + n_bytes > self.size:
                raise TensorOutOfBounds(name, data_offset, n_bytes, self.size)
            np_dims = tuple(reversed(dims))
            raw = plain[data_offset:data_offset + n_bytes]
            if qtype.name in FLOAT_ARRAYS:
                data = raw.view(FLOAT_ARRAYS[qtype.name]).reshape(np_dims)
            else:  # one row of bytes per row of blocks, like GGUFReader
                data = raw.reshape(*np_dims[:-1], np_dims[-1] // block * type_size)
            self.tensors.append(Tensor(name, qtype, np.array(dims, dtype=np.int64), data, data_offset, n_bytes))

    def _parse_header(self, buf: memoryview) -> list[tuple[str, list[int], int, int]]:
        """Fill ``self.metadata``; the tensor infos (name, dims, type id, offset), unchecked."""
        magic, version, n_tensors, n_kv = self._unpack(buf, "<4sIQQ")
        if magic != b"GGUF":
            raise GGUFFormatError(f"it starts with {magic!r}, not the magic bytes b'GGUF'")
        if version not in VERSIONS:
            if int.from_bytes(version.to_bytes(4, "little"), "big") in VERSIONS:  # e.g. 3 << 24
                raise BigEndian(version)
            raise UnsupportedVersion(version)
        # each metadata entry takes >= 13 bytes (key length, type, one byte), each tensor info >= 24
        self._need(n_kv * 13, f"{n_kv} metadata entries")
        self._need(n_tensors * 24, f"{n_tensors} tensor infos")
        self.metadata: dict[str, Any] = {}
        for index in range(n_kv):
            self.where = f"metadata entry #{index}" + (f" (after {key!r})" if index else "")
            key = self._string(buf)
            self.where = f"metadata key {key!r}"
            if key in self.metadata:
                raise GGUFFormatError(f"metadata key {key!r} appears twice")
            (kind,) = self._unpack(buf, "<I")
            self.metadata[key] = self._value(buf, kind, key)
        infos = []
        for index in range(n_tensors):
            self.where = f"tensor info #{index}"
            name = self._string(buf)
            self.where = f"tensor {name!r}"
            (n_dims,) = self._unpack(buf, "<I")
            if not 1 <= n_dims <= MAX_DIMS:
                raise GGUFFormatError(f"tensor {name!r} has {n_dims} dimensions; GGUF allows 1 to {MAX_DIMS}")
            dims = [int(d) for d in self._unpack(buf, f"<{n_dims}Q")]
            kind, offset = self._unpack(buf, "<IQ")
            infos.append((name, dims, kind, offset))
        return infos

    def _need(self, n_bytes: int, what: str) -> None:
        if self.pos + n_bytes > self.size:
            raise Truncated(f"{self.where}: {what} at byte {self.pos} needs {n_bytes} bytes, more than the "
                            f"{self.size - self.pos} left")

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
        size = struct.calcsize(fmt)
        self._need(size, "a value")
        values = struct.unpack_from(fmt, buf, self.pos)
        self.pos += size
        return values

    def _string(self, buf: memoryview) -> str:
        (length,) = self._unpack(buf, "<Q")
        self._need(length, f"a string of {length} bytes")
        start, self.pos = self.pos, self.pos + length
        return _utf8(buf[start:self.pos], self.where)

    def _value(self, buf: memoryview, kind: int, key: str, depth: int = 0) -> Any:
        if kind == STRING:
            return self._string(buf)
        if kind in SCALARS:
            return self._unpack(buf, SCALARS[kind])[0]
        if kind != ARRAY:
            raise GGUFFormatError(f"metadata key {key!r} has unknown value type {kind}")
        item, count = self._unpack(buf, "<IQ")
        if item in NUMPY:
            self._need(count * np.dtype(NUMPY[item]).itemsize, f"an array of {count} values")
            values = np.frombuffer(buf, dtype=NUMPY[item], count=count, offset=self.pos)
            self.pos += values.nbytes
            return values.tolist()
        if item == STRING:
            self._need(count * 8, f"an array of {count} strings")
            # The hot loop of a fresh load (SmolLM2: 98k strings): one bounds check per string;
            # a length field past the end makes unpack_from raise struct.error.
            strings, pos, size = [], self.pos, self.size
            unpack, append = struct.Struct("<Q").unpack_from, strings.append
            try:
                for _ in range(count):
                    (length,) = unpack(buf, pos)
                    start = pos + 8
                    pos = start + length
                    if pos > size:
                        pos = start - 8  # the string that runs past the end, named below
                        break
                    append(str(buf[start:pos], "utf-8"))
                else:
                    self.pos = pos
                    return strings
            except struct.error:
                pass
            except UnicodeDecodeError:
                _utf8(buf[start:pos], f"{key}[{len(strings)}]")  # raises, naming the entry
            self.pos = pos
            raise Truncated(f"{self.where}: string {len(strings)} of {count} at byte {pos} runs past the end of "
                            f"the file")
        if item != ARRAY and item not in SCALARS:
            raise GGUFFormatError(f"metadata key {key!r} is an array of unknown value type {item}")
        if depth >= MAX_ARRAY_NESTING:
            raise GGUFFormatError(f"metadata key {key!r} nests arrays more than {MAX_ARRAY_NESTING} deep")
        self._need(count * 12, f"an array of {count} arrays")
        return [self._value(buf, item, key, depth + 1) for _ in range(count)]  # nested arrays: rare


def _utf8(raw: memoryview, where: str) -> str:
    try:
        return str(raw, "utf-8")
    except UnicodeDecodeError as exc:
        shown = bytes(raw[max(exc.start - 8, 0):exc.start + 8])
        raise GGUFFormatError(f"{where} is not UTF-8 text (byte {exc.start}: {shown!r})") from None


class GGUFFormatError(ValueError):
    """The bytes are not a well-formed GGUF file; the message says where."""


class Truncated(GGUFFormatError):
    """A count or length points past the end of the file."""


class BigEndian(GGUFFormatError):
    """The version field reads byte-swapped: a big-endian file (s390x builds write them)."""


class UnsupportedVersion(GGUFFormatError):
    def __init__(self, version: int) -> None:
        super().__init__(f"GGUF version {version}")
        self.version = version


class TensorOutOfBounds(ValueError):
    def __init__(self, name: str, start: int, n_bytes: int, size: int) -> None:
        super().__init__(name)
        self.name, self.start, self.n_bytes, self.size = name, start, n_bytes, size


class UnknownTensorType(ValueError):
    def __init__(self, name: str, kind: int) -> None:
        super().__init__(name)
        self.name, self.kind = name, kind
