"""A GGUF checkpoint's metadata: validated at start, then its config and tokenizer through transformers.

``gguf.GGUFReader`` reads the header and tensor table (tensor data stays memory-mapped);
transformers' GGUF support turns the metadata into a ``PretrainedConfig`` and a tokenizer (with the
chat template the file carries). Every check that can fail runs in ``open_gguf``, before any weight
is read: an architecture or tensor type halserve cannot load, a truncated or foreign file.
"""
from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from typing import Any

from halserve.models.gguf.files import gguf_shards

logger = logging.getLogger(__name__)

# GGUF ``general.architecture`` -> the model families halserve serves under it
SUPPORTED_ARCHITECTURES = {
    "gemma3": "Gemma 3 text",
    "llama": "Llama, Mistral, SmolLM",
    "phi3": "Phi-3",
    "qwen2": "Qwen2, Qwen2.5",
    "qwen3": "Qwen3",
}
# transformers' model_type of a GGUF's config -> the architecture halserve builds for it
ARCHITECTURE_OF_MODEL_TYPE = {
    "gemma3_text": "Gemma3ForCausalLM",
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
INSTALL_HINT = "pip install 'halserve[gguf]' (or pip install 'gguf>=0.10')"


@dataclass
class GGUFCheckpoint:
    """One GGUF model, validated: its shards' readers and what the loading path needs from them."""

    path: str  # the first shard (the one holding the metadata)
    shards: list[str]  # every shard, in order
    readers: list[Any]  # a gguf.GGUFReader per shard
    architecture: str  # general.architecture, e.g. "llama"
    tensor_types: dict[str, int]  # tensor type name (e.g. "Q4_1") -> how many tensors have it

    @property
    def folder(self) -> str:
        return os.path.dirname(os.path.abspath(self.path))

    @property
    def tensor_names(self) -> list[str]:
        return [t.name for reader in self.readers for t in reader.tensors]

    def describe(self) -> str:
        types = ", ".join(f"{n} {name}" for name, n in sorted(self.tensor_types.items()))
        return f"{os.path.basename(self.path)} ({self.architecture}; {len(self.shards)} file(s); tensors: {types})"


def _gguf() -> Any:
    try:
        import gguf
    except ImportError as exc:
        raise ValueError(f"loading a GGUF checkpoint needs the gguf package: {INSTALL_HINT}") from exc
    return gguf


@functools.lru_cache(maxsize=8)
def _can_dequantize(type_name: str) -> bool:
    """``gguf.quants.dequantize`` implements this tensor type (probed on one zero block)."""
    import numpy as np

    gguf = _gguf()
    qtype = gguf.GGMLQuantizationType[type_name]
    block_size, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    if qtype == gguf.GGMLQuantizationType.F32:
        return True
    try:
        gguf.quants.dequantize(np.zeros(block_bytes, dtype=np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


def supported_tensor_types() -> list[str]:
    """Every GGUF tensor type halserve can load (those the gguf package dequantizes)."""
    return [t.name for t in _gguf().GGMLQuantizationType if _can_dequantize(t.name)]


def _read(path: str) -> Any:
    """A ``GGUFReader`` of ``path``; a truncated or foreign file is a ``ValueError`` naming it."""
    gguf = _gguf()
    try:
        reader = gguf.GGUFReader(path)
    except Exception as exc:  # numpy/struct errors past the end of a truncated header, bad magic ...
        raise ValueError(f"{path!r} is not a readable GGUF file (truncated or corrupt?): "
                         f"{type(exc).__name__}: {exc}") from exc
    size = os.path.getsize(path)
    for tensor in reader.tensors:
        if tensor.data_offset + int(tensor.n_bytes) > size:
            raise ValueError(f"{path!r} is truncated: tensor {tensor.name!r} ends at byte "
                             f"{tensor.data_offset + int(tensor.n_bytes)} but the file has {size} bytes; "
                             "download it again")
    return reader


def _field(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else field.contents()


@functools.lru_cache(maxsize=4)
def open_gguf(path: str) -> GGUFCheckpoint:
    """Read and validate the GGUF checkpoint whose first shard is ``path`` (cached: the engine and
    the model loader both ask)."""
    shards = gguf_shards(path)
    readers = [_read(s) for s in shards]
    architecture = _field(readers[0], "general.architecture")
    if architecture not in SUPPORTED_ARCHITECTURES:
        families = "; ".join(f"{a} ({f})" for a, f in SUPPORTED_ARCHITECTURES.items())
        raise ValueError(f"GGUF architecture {architecture!r} of {os.path.basename(path)!r} is not supported; "
                         f"halserve loads GGUF files of these architectures: {families}")
    declared = _field(readers[0], "split.count")
    if declared is not None and int(declared) != len(shards):
        raise ValueError(f"{os.path.basename(path)!r} declares {declared} split files (split.count) but its name "
                         f"gives {len(shards)}; pass the first shard of a complete split set")
    types: dict[str, int] = {}
    for reader in readers:
        for tensor in reader.tensors:
            types[tensor.tensor_type.name] = types.get(tensor.tensor_type.name, 0) + 1
            if not _can_dequantize(tensor.tensor_type.name):
                raise ValueError(
                    f"tensor {tensor.name!r} of {os.path.basename(path)!r} has GGUF type "
                    f"{tensor.tensor_type.name}, which halserve cannot load; supported types: "
                    f"{', '.join(supported_tensor_types())}")
    return GGUFCheckpoint(path=path, shards=shards, readers=readers, architecture=architecture, tensor_types=types)


def load_gguf_config(path: str, hf_config_path: str | None = None, trust_remote_code: bool = False) -> Any:
    """The transformers config of the GGUF checkpoint ``path``: from its metadata (transformers' GGUF
    support), or from ``hf_config_path`` (a folder or hub id holding config.json) when given."""
    from transformers import AutoConfig

    checkpoint = open_gguf(path)
    if hf_config_path is not None:
        hf_config = AutoConfig.from_pretrained(hf_config_path, trust_remote_code=trust_remote_code)
    else:
        hf_config = _load_kept(path, "config", AutoConfig.from_pretrained)
        if hf_config is None:
            hf_config = AutoConfig.from_pretrained(checkpoint.folder, gguf_file=os.path.basename(path),
                                                   trust_remote_code=trust_remote_code)
            _keep(hf_config, path, "config")
        # transformers decides from the first file alone; a split set may keep output.weight in another
        hf_config.tie_word_embeddings = "output.weight" not in checkpoint.tensor_names
    if not getattr(hf_config, "architectures", None):
        arch = ARCHITECTURE_OF_MODEL_TYPE.get(hf_config.model_type)
        if arch is None:
            raise ValueError(f"the config of {path!r} has model_type {hf_config.model_type!r}, which halserve "
                             f"does not serve from GGUF; supported: {', '.join(sorted(ARCHITECTURE_OF_MODEL_TYPE))}")
        hf_config.architectures = [arch]
    return hf_config


CACHE_ENV = "HALSERVE_GGUF_CACHE"  # where converted configs and tokenizers are kept; "off": convert every time
_COMPLETE = "halserve-complete"


def converted_cache_dir(path: str) -> str | None:
    """Where the config and tokenizer converted from ``path``'s metadata are kept: a folder per file (its real
    path, size and mtime) and transformers version, under ``$HALSERVE_GGUF_CACHE`` or
    ``~/.cache/halserve/gguf``; None when the cache is ``off`` or the file cannot be stat'ed."""
    import hashlib

    import transformers

    root = os.environ.get(CACHE_ENV, "").strip()
    if root.lower() == "off":
        return None
    if not root:
        cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(cache, "halserve", "gguf")
    try:
        real = os.path.realpath(path)
        stat = os.stat(real)
    except OSError:
        return None
    key = hashlib.sha256(repr((real, stat.st_size, stat.st_mtime_ns, transformers.__version__)).encode())
    name = os.path.splitext(os.path.basename(real))[0]
    return os.path.join(root, f"{name}-{key.hexdigest()[:16]}")


def load_gguf_tokenizer(path: str, trust_remote_code: bool = False) -> Any:
    """The tokenizer (and chat template) stored in the GGUF checkpoint ``path``'s metadata.

    transformers converts it (and the config) from the file's metadata, parsing every field of it, the
    49,152-token vocabulary included: ~3 s a pass for SmolLM2 on two cores, on the API server's and the
    engine's start-up paths. So what it converts is saved once per file (``converted_cache_dir``) and later
    starts load those folders (~0.3 s); a copy that fails to load is converted again."""
    from transformers import AutoTokenizer

    tokenizer = _load_kept(path, "tokenizer", AutoTokenizer.from_pretrained)
    if tokenizer is None:
        checkpoint = open_gguf(path)
        tokenizer = AutoTokenizer.from_pretrained(checkpoint.folder, gguf_file=os.path.basename(path),
                                                  trust_remote_code=trust_remote_code)
        _keep(tokenizer, path, "tokenizer")
    return tokenizer


def _load_kept(path: str, what: str, load: Any) -> Any:
    """``load(folder)`` of the kept ``what`` ("config", "tokenizer") of ``path``, or None (none kept, or it
    did not load: then it is converted again)."""
    base = converted_cache_dir(path)
    folder = None if base is None else os.path.join(base, what)
    if folder is None or not os.path.isfile(os.path.join(folder, _COMPLETE)):
        return None
    try:
        return load(folder)
    except Exception as exc:  # noqa: BLE001 - a damaged copy: the caller converts again
        logger.warning("the kept %s of %s in %s did not load (%s: %s); converting it again", what,
                       os.path.basename(path), folder, type(exc).__name__, exc)
        return None


def _keep(converted: Any, path: str, what: str) -> None:
    """``converted.save_pretrained`` into a fresh folder, then renamed into place (another process may be
    doing the same: the first rename wins, the others' copies are dropped); best effort."""
    import shutil
    import tempfile

    base = converted_cache_dir(path)
    if base is None:
        return
    folder = os.path.join(base, what)
    try:
        os.makedirs(base, exist_ok=True)
        staging = tempfile.mkdtemp(prefix=f".{what}-", dir=base)
        converted.save_pretrained(staging)
        open(os.path.join(staging, _COMPLETE), "w").close()
        if os.path.isdir(folder):
            shutil.rmtree(folder, ignore_errors=True)  # (an incomplete or damaged copy)
        try:
            os.rename(staging, folder)
        except OSError:  # another process's copy landed first
            shutil.rmtree(staging, ignore_errors=True)
    except OSError as exc:
        logger.warning("could not keep the converted %s in %s (%s); the next start converts it again", what,
                       folder, exc)
