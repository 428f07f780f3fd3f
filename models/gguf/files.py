"""Which GGUF file a model argument names: a ``.gguf`` file, a split set, or a folder holding one.

    model.gguf                              -> [model.gguf]
    model-00001-of-00003.gguf               -> [model-00001-of-00003.gguf, ...-00002-..., ...-00003-...]
    folder/ (one GGUF or one split set,     -> that file's shards
             no *.safetensors)
"""
from __future__ import annotations

import glob
import os
import re

GGUF_SUFFIX = ".gguf"
GGUF_MAGIC = b"GGUF"
# llama.cpp's gguf-split names: <stem>-00001-of-00003.gguf
SPLIT_NAME = re.compile(r"^(?P<stem>.*)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$")


def is_gguf_file(path: str) -> bool:
    """``path`` is a file that starts with GGUF's magic bytes."""
    if not os.path.isfile(path):
        return False
    with open(path, "rb") as f:
        return f.read(4) == GGUF_MAGIC


def find_gguf_file(model: str) -> str | None:
    """The GGUF checkpoint ``model`` names (its first shard), or None if it names none (a folder of
    safetensors, a hub id). A ``.gguf`` path that does not exist, a folder of several GGUF models, or a
    split set with a missing shard is a ``ValueError``."""
    if model.lower().endswith(GGUF_SUFFIX):
        if not os.path.exists(model):
            raise ValueError(f"GGUF file {model!r} does not exist; pass the path of a .gguf file (or of the "
                             "folder holding it)")
        if not os.path.isfile(model):
            raise ValueError(f"{model!r} is not a file; pass the path of a .gguf file")
        return gguf_shards(model)[0]
    if is_gguf_file(model):  # a GGUF saved without the suffix
        return model
    if not os.path.isdir(model) or glob.glob(os.path.join(model, "*.safetensors")):
        return None
    files = sorted(glob.glob(os.path.join(model, "*" + GGUF_SUFFIX)))
    models = sorted({gguf_shards(f)[0] for f in files})
    if len(models) > 1:
        names = ", ".join(os.path.basename(m) for m in models)
        raise ValueError(f"folder {model!r} holds several GGUF models ({names}); pass the path of the one to load")
    return models[0] if models else None


def gguf_shards(path: str) -> list[str]:
    """Every shard of the GGUF checkpoint ``path`` belongs to, in order (``[path]`` if it is not split)."""
    match = SPLIT_NAME.match(os.path.basename(path))
    if match is None:
        return [path]
    folder, stem, count = os.path.dirname(path), match["stem"], int(match["count"])
    shards = [os.path.join(folder, f"{stem}-{i:05d}-of-{count:05d}{GGUF_SUFFIX}") for i in range(1, count + 1)]
    missing = [os.path.basename(s) for s in shards if not os.path.isfile(s)]
    if missing:
        raise ValueError(f"split GGUF {os.path.basename(path)!r} has {count} shards but {', '.join(missing)} "
                         f"{'is' if len(missing) == 1 else 'are'} missing from {folder or '.'!r}")
    return shards
