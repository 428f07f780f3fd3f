"""GGUF checkpoints (llama.cpp's format): find, validate, and load them with weights dequantized.

    find_gguf_file(model)             the GGUF a model argument names (file, split set, folder), else None
    open_gguf(path)                   read + validate: architecture, split set, tensor types, truncation
    load_gguf_config(path, ...)       transformers config from the metadata (or --hf-config-path)
    load_gguf_tokenizer(path)         tokenizer + chat template from the metadata
    check_tokenizer_metadata(path)    the metadata holds a tokenizer transformers can build (before loading weights)
    gguf_tensor_types(path, config)   {HF weight name: GGUF type} (what the gguf quantization method reads)
    iterate_gguf_weights(path, ...)   (HF name, tensor) pairs, dequantized to the model dtype or kept as blocks
"""
from halserve.models.gguf.files import find_gguf_file, gguf_shards
from halserve.models.gguf.reader import (
    SUPPORTED_ARCHITECTURES,
    GGUFCheckpoint,
    check_tokenizer_metadata,
    load_gguf_config,
    load_gguf_tokenizer,
    open_gguf,
    supported_tensor_types,
)
from halserve.models.gguf.weights import gguf_tensor_types, iterate_gguf_weights

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "GGUFCheckpoint",
    "check_tokenizer_metadata",
    "find_gguf_file",
    "gguf_shards",
    "gguf_tensor_types",
    "iterate_gguf_weights",
    "load_gguf_config",
    "load_gguf_tokenizer",
    "open_gguf",
    "supported_tensor_types",
]
