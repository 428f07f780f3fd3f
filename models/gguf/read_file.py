"""One GGUF file's header, metadata and tensor table, read through ``gguf.GGUFReader`` with every way a
foreign or damaged file fails turned into a ``ValueError`` that names the file, says what is wrong and what to do.

    empty, or no b"GGUF" magic (a text file, a Git LFS pointer)   -> "is not a GGUF file"
    a GGUF version the gguf package cannot read                    -> the version, and which it reads
    cut short in its header, metadata, tensor table or data        -> "is truncated": where, and its size
    a tensor type number the gguf package does not know            -> the tensor and the number

``gguf.GGUFReader`` reads past the end of a short file as empty numpy views, and fails wherever that lands
first (an IndexError, a numpy view or reshape error); the reader here checks each read's bounds instead.
"""
from __future__ import annotations

import functools
import math
import os
from typing import Any

from halserve.models.gguf.files import GGUF_MAGIC

DOWNLOAD_AGAIN = "download or convert it again"


class _Truncated(Exception):
    """A read past the end of the file: which part of it (``section``), and the byte it needed."""

    def __init__(self, section: str, end: int, tensor: str | None = None) -> None:
        super().__init__(section, end, tensor)
        self.section, self.end, self.tensor = section, end, tensor


class _UnknownTensorType(Exception):
    def __init__(self, tensor: str, type_number: int) -> None:
        super().__init__(tensor, type_number)
        self.tensor, self.type_number = tensor, type_number


@functools.cache
def _checked_reader_class() -> type:
    """``gguf.GGUFReader`` with bounds-checked reads (a subclass made on first use: ``gguf`` is imported
    only when a GGUF file is read)."""
    import gguf
    import numpy as np

    class CheckedReader(gguf.GGUFReader):
        section = "header"

        def _get(self, offset: int, dtype: Any, count: int = 1, *args: Any, **kwargs: Any) -> Any:
            end = int(offset) + np.dtype(dtype).itemsize * int(count)
            if end > len(self.data):
                raise _Truncated(self.section, end)
            return super()._get(offset, dtype, count, *args, **kwargs)

        def _build_fields(self, *args: Any, **kwargs: Any) -> Any:
            self.section = "metadata"
            return super()._build_fields(*args, **kwargs)

        def _build_tensor_info(self, *args: Any, **kwargs: Any) -> Any:
            self.section = "tensor table"
            return super()._build_tensor_info(*args, **kwargs)

        def _build_tensors(self, start_offs: int, fields: list[Any]) -> Any:
            self.section = "tensor data"
            known = {int(t) for t in gguf.GGMLQuantizationType}
            for field in fields:
                _, name, _, dims, type_number, offset = field.parts  # (name length, name, n_dims, dims, type, offset)
                name, type_number = bytes(name).decode("utf-8", "replace"), int(type_number[0])
                if type_number not in known:
                    raise _UnknownTensorType(name, type_number)
                block_size, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(type_number)]
                num_values = math.prod(int(d) for d in dims.tolist())
                end = int(start_offs) + int(offset[0]) + num_values * block_bytes // block_size
                if end > len(self.data):
                    raise _Truncated("tensor data", end, tensor=name)
            return super()._build_tensors(start_offs, fields)

    return CheckedReader


def _check_magic_and_version(path: str, size: int) -> None:
    from gguf.gguf_reader import READER_SUPPORTED_VERSIONS

    with open(path, "rb") as f:
        head = f.read(8)
    if size == 0:
        raise ValueError(f"{path!r} is empty (0 bytes), not a GGUF model (an interrupted download leaves an empty "
                         f"file); {DOWNLOAD_AGAIN}")
    if not head.startswith(GGUF_MAGIC) and not (size < 4 and GGUF_MAGIC.startswith(head)):
        what = ("a Git LFS pointer, not the model itself: fetch the file with `git lfs pull` or the hub's download"
                if head.startswith(b"version ") else
                "a text file, an HTML error page, or another format renamed .gguf?")
        raise ValueError(f"{path!r} is not a GGUF file: it starts with {head[:4]!r}, not GGUF's magic "
                         f"{GGUF_MAGIC!r} ({what}); pass a .gguf file written by llama.cpp's converter")
    if size < 8:
        raise ValueError(f"{path!r} is truncated: it has {size} bytes, fewer than a GGUF header; {DOWNLOAD_AGAIN}")
    version = int.from_bytes(head[4:8], "little")
    if version & 0xFFFF == 0:  # (written on a machine of the other byte order)
        version = int.from_bytes(head[4:8], "big")
    if version not in READER_SUPPORTED_VERSIONS:
        raise ValueError(
            f"{path!r} is GGUF version {version}, which the installed gguf package cannot read (it reads versions "
            f"{', '.join(map(str, READER_SUPPORTED_VERSIONS))}); a newer file needs a newer package "
            "(pip install -U gguf), an older one converting again with a current llama.cpp")


def read_gguf_file(path: str) -> Any:
    """A ``gguf.GGUFReader`` of ``path`` (tensor data memory-mapped); a foreign, damaged or truncated file is a
    ``ValueError`` naming it."""
    try:
        import gguf  # noqa: F401
    except ImportError as exc:
        from halserve.models.gguf.reader import INSTALL_HINT

        raise ValueError(f"loading a GGUF checkpoint needs the gguf package: {INSTALL_HINT}") from exc
    size = os.path.getsize(path)
    _check_magic_and_version(path, size)
    try:
        return _checked_reader_class()(path)
    except _Truncated as cut:
        what = f"tensor {cut.tensor!r} ends at byte {cut.end}" if cut.tensor else f"reading it needs {cut.end} bytes"
        raise ValueError(f"{path!r} is truncated in its {cut.section}: {what} but the file has {size}; "
                         f"{DOWNLOAD_AGAIN}") from None
    except _UnknownTensorType as unknown:
        from halserve.models.gguf.reader import supported_tensor_types

        raise ValueError(
            f"tensor {unknown.tensor!r} of {path!r} has GGUF type number {unknown.type_number}, which the installed "
            "gguf package does not know (a type newer than the package, or a damaged file); upgrade it "
            f"(pip install -U gguf) or use a file of a type halserve loads: {', '.join(supported_tensor_types())}"
        ) from None
    except Exception as exc:  # a duplicate key or tensor, a bad alignment, an unknown metadata value type ...
        # (or a gguf release whose private reader methods, which CheckedReader overrides, changed: then the plain
        # reader reads a sound file, and only a damaged one fails with the generic message)
        try:
            import gguf

            return gguf.GGUFReader(path)
        except Exception:  # noqa: BLE001 - reported as the checked reader's error
            pass
        raise ValueError(f"{path!r} is not a readable GGUF file (truncated or corrupt?): {type(exc).__name__}: "
                         f"{exc}; {DOWNLOAD_AGAIN}") from exc
