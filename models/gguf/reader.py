"""A GGUF checkpoint's metadata: validated at start, then its config and tokenizer through transformers.

``gguf.GGUFReader`` reads the header and tensor table (tensor data stays memory-mapped; read_file.py);
transformers' GGUF support turns the metadata into a ``PretrainedConfig`` and a tokenizer (with the
chat template the file carries). Every check that can fail runs before any weight is read: in
``open_gguf`` (a truncated or foreign file, an architecture or tensor type halserve cannot load, split
files that are not one set), then before each conversion (metadata keys the config or tokenizer needs),
so transformers' own errors for malformed metadata are never what a user reads.
"""
from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from typing import Any

from halserve.models.gguf.files import gguf_shards
from halserve.models.gguf.read_file import read_gguf_file

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


def _field(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def _check_split_set(shards: list[str], readers: list[Any]) -> None:
    """Every shard of a split set says it is that shard of a set this size (``split.no``, ``split.count``), no
    tensor is in two shards, and together they hold the ``split.tensors.count`` tensors the first declares: a
    shard renamed from another model's set (or another shard of this one) fails here, naming it."""
    again = "download the split set again (every file from the same model)"
    first = os.path.basename(shards[0])
    seen: dict[str, str] = {}
    for index, (shard, reader) in enumerate(zip(shards, readers)):
        name = os.path.basename(shard)
        number, count = _field(reader, "split.no"), _field(reader, "split.count")
        if number is None or count is None:
            raise ValueError(f"{name!r} is named as shard {index + 1} of {len(shards)} but its metadata has no "
                             f"split.no/split.count: it is not a shard of a split set (a whole model renamed?); {again}")
        if int(count) != len(shards):
            raise ValueError(f"{name!r} belongs to a split set of {count} files (split.count) but {first!r} "
                             f"starts a set of {len(shards)}: it is a shard of a different model; {again}")
        if int(number) != index:
            raise ValueError(f"{name!r} is shard {int(number) + 1} of its set (split.no), not shard {index + 1} as "
                             f"its name says: a shard renamed or copied from another; {again}")
        for tensor in reader.tensors:
            if tensor.name in seen:
                raise ValueError(f"tensor {tensor.name!r} is in both {seen[tensor.name]!r} and {name!r}: the split "
                                 f"files are not one model's; {again}")
            seen[tensor.name] = name
    declared = _field(readers[0], "split.tensors.count")
    if declared is not None and int(declared) != len(seen):
        raise ValueError(f"{first!r} declares {declared} tensors across its split set (split.tensors.count) but its "
                         f"{len(shards)} files hold {len(seen)}: a shard is from a different model; {again}")


@functools.lru_cache(maxsize=4)
def open_gguf(path: str) -> GGUFCheckpoint:
    """Read and validate the GGUF checkpoint whose first shard is ``path`` (cached: the engine and
    the model loader both ask)."""
    shards = gguf_shards(path)
    readers = [read_gguf_file(s) for s in shards]
    architecture = _field(readers[0], "general.architecture")
    families = "; ".join(f"{a} ({f})" for a, f in SUPPORTED_ARCHITECTURES.items())
    if architecture is None:
        raise ValueError(f"{os.path.basename(path)!r} has no general.architecture in its metadata, so which model it "
                         "holds is unknown (not written by llama.cpp's converter, or damaged); convert it again with "
                         f"llama.cpp's convert_hf_to_gguf.py. halserve loads these GGUF architectures: {families}")
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"GGUF architecture {architecture!r} of {os.path.basename(path)!r} is not supported; "
                         f"halserve loads GGUF files of these architectures: {families}")
    declared = _field(readers[0], "split.count")
    if declared is not None and int(declared) != len(shards):
        raise ValueError(f"{os.path.basename(path)!r} declares {declared} split files (split.count) but its name "
                         f"gives {len(shards)}; pass the first shard of a complete split set")
    if len(shards) > 1:
        _check_split_set(shards, readers)
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
        hf_config = _load_config_override(hf_config_path, trust_remote_code)
    else:
        _check_config_metadata(checkpoint)
        hf_config = _load_kept(path, "config", AutoConfig.from_pretrained)
        if hf_config is None:
            try:
                hf_config = AutoConfig.from_pretrained(checkpoint.folder, gguf_file=os.path.basename(path),
                                                       trust_remote_code=trust_remote_code)
            except Exception as exc:  # noqa: BLE001 - transformers' errors for malformed metadata vary
                raise ValueError(
                    f"the metadata of {os.path.basename(path)!r} does not make a {checkpoint.architecture} config "
                    f"({type(exc).__name__}: {_one_line(exc)}); the file is damaged or was written by another "
                    "converter: convert it again with llama.cpp's convert_hf_to_gguf.py, or pass --hf-config-path "
                    "with the model's config.json") from exc
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


# the metadata keys (after "<architecture>.") every supported architecture's config is built from: transformers
# fills a missing one with its own default, which then disagrees with the file's tensors (or its context length)
CONFIG_KEYS = ("context_length", "embedding_length", "block_count", "feed_forward_length", "attention.head_count")
# and the RMSNorm epsilon every supported architecture's layers use (llama.cpp refuses a file without it; transformers
# would take its own default, 1e-6 for Llama, where SmolLM2's is 1e-5: other numbers, silently)
EPS_KEY = "attention.layer_norm_rms_epsilon"


def _one_line(exc: BaseException) -> str:
    """A library's error message on one line (transformers' span several)."""
    return " ".join(str(exc).split())


def _check_config_metadata(checkpoint: GGUFCheckpoint) -> None:
    """``ValueError`` naming every ``CONFIG_KEYS`` entry missing from the metadata or not a positive integer, and
    ``EPS_KEY`` missing or not a positive number."""
    reader, name = checkpoint.readers[0], os.path.basename(checkpoint.path)
    checks = [(k, lambda v: isinstance(v, int) and v > 0, "a positive integer") for k in CONFIG_KEYS]
    checks.append((EPS_KEY, lambda v: isinstance(v, (int, float)) and 0 < v < 1,
                   "a small positive number (an RMSNorm epsilon, e.g. 1e-05)"))
    bad = []
    for suffix, valid, expected in checks:
        key = f"{checkpoint.architecture}.{suffix}"
        value = _field(reader, key)
        if value is None:
            bad.append(f"{key} is missing")
        elif isinstance(value, bool) or not valid(value):
            bad.append(f"{key} is {value!r}, not {expected}")
    if bad:
        raise ValueError(f"the metadata of {name!r} cannot describe its model: {'; '.join(bad)}. The file is damaged "
                         "or was not written by llama.cpp's converter: convert it again with convert_hf_to_gguf.py, "
                         "or pass --hf-config-path with the model's config.json")


def _load_config_override(hf_config_path: str, trust_remote_code: bool) -> Any:
    """The config ``--hf-config-path`` names, for a GGUF checkpoint; ``ValueError`` saying what it must be."""
    from transformers import AutoConfig

    from halserve.models.gguf.files import is_gguf_file

    if is_gguf_file(hf_config_path):
        raise ValueError(f"--hf-config-path {hf_config_path!r} is a GGUF file; it takes a folder or hub id holding a "
                         "config.json (a GGUF model's own config comes from its metadata: drop the flag)")
    try:
        return AutoConfig.from_pretrained(hf_config_path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise ValueError(f"--hf-config-path {hf_config_path!r} holds no usable config.json ({_one_line(exc)}); pass "
                         "the folder or hub id of the model's config.json, or drop the flag to use the GGUF's "
                         "metadata") from exc


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
        check_tokenizer_metadata(path)
        try:
            tokenizer = AutoTokenizer.from_pretrained(checkpoint.folder, gguf_file=os.path.basename(path),
                                                      trust_remote_code=trust_remote_code)
        except Exception as exc:  # noqa: BLE001 - transformers' errors for malformed metadata vary
            raise ValueError(f"the tokenizer in the metadata of {os.path.basename(path)!r} could not be built "
                             f"({type(exc).__name__}: {_one_line(exc)}); {TOKENIZER_HINT}") from exc
        _keep(tokenizer, path, "tokenizer")
    return tokenizer


TOKENIZER_HINT = ("pass --tokenizer (LLM(tokenizer=...)) with the model's tokenizer: the folder or hub id of its "
                  "Hugging Face checkpoint")
SPECIAL_TOKEN_KEYS = ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id")


def check_tokenizer_metadata(path: str) -> None:
    """``ValueError`` when the metadata of the GGUF checkpoint ``path`` holds no tokenizer transformers can build:
    no ``tokenizer.ggml.model`` or ``tokens``, no merges (nor scores to derive them from), a special token id past
    the vocabulary. (Cheap: the model loader asks at start, before any weight is read.)"""
    reader, name = open_gguf(path).readers[0], os.path.basename(path)
    fields = reader.fields
    missing = [k for k in ("tokenizer.ggml.model", "tokenizer.ggml.tokens") if k not in fields]
    if missing:
        raise ValueError(f"{name!r} holds no tokenizer: {' and '.join(missing)} "
                         f"{'is' if len(missing) == 1 else 'are'} missing from its metadata; {TOKENIZER_HINT}")
    if "tokenizer.ggml.merges" not in fields and "tokenizer.ggml.scores" not in fields:
        raise ValueError(f"the tokenizer in the metadata of {name!r} is incomplete: it has neither "
                         f"tokenizer.ggml.merges nor tokenizer.ggml.scores to derive them from; {TOKENIZER_HINT}")
    num_tokens = len(fields["tokenizer.ggml.tokens"].data)
    for key in (f"tokenizer.ggml.{k}" for k in SPECIAL_TOKEN_KEYS):
        token_id = _field(reader, key)
        if token_id is not None and not (isinstance(token_id, int) and 0 <= token_id < num_tokens):
            raise ValueError(f"{key} of {name!r} is {token_id!r}, not a token of its {num_tokens}-token vocabulary "
                             f"(tokenizer.ggml.tokens); the file is damaged: download or convert it again, or "
                             f"{TOKENIZER_HINT}")


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
