"""GGUF checkpoints (halserve.models.gguf): tiny files written here with the gguf package's writer, one per
supported architecture, greedy output token-identical to transformers reading the same file (both dequantize
to float32); split files, folders, --tokenizer/--hf-config-path overrides; and the errors for what cannot
be loaded (architecture, tensor type, truncated file, missing path)."""
from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf", reason="the GGUF tests need the gguf package (pip install 'halserve[gguf]')")

HIDDEN, INTERMEDIATE, LAYERS, CONTEXT = 64, 128, 2, 256
NEW_TOKENS = 12
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# architecture -> (num_heads, num_kv_heads, head_dim); Qwen3's GGUF config has no head size: transformers' 128
SHAPES = {"llama": (4, 2, 16), "qwen2": (4, 2, 16), "qwen3": (2, 1, 128), "gemma3": (4, 2, 16), "phi3": (4, 4, 16)}
T = gguf.GGMLQuantizationType


def _byte_alphabet() -> list[str]:
    """GPT-2's byte -> printable character table (a byte-level BPE vocabulary spells tokens in it)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def _vocab() -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges): 256 bytes, 49 two-letter merges, 3 control tokens."""
    tokens = _byte_alphabet()
    merges = [f"{a} {b}" for a in "Ġetaoin" for b in "etaoins"]
    tokens += [m.replace(" ", "") for m in merges] + SPECIAL_TOKENS
    types = [1] * (len(tokens) - len(SPECIAL_TOKENS)) + [3] * len(SPECIAL_TOKENS)  # 1 NORMAL, 3 CONTROL
    return tokens, types, merges


VOCAB = len(_vocab()[0])


def _tensors(arch: str, tied: bool, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Random weights under GGUF's tensor names and torch-order shapes ([out, in])."""
    heads, kv_heads, head_dim = SHAPES[arch]
    std = 1.0 / np.sqrt(HIDDEN)

    def w(*shape):
        return (std * rng.standard_normal(shape)).astype(np.float32)

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    out = {"token_embd.weight": w(VOCAB, HIDDEN), "output_norm.weight": norm(HIDDEN)}
    if not tied:
        out["output.weight"] = w(VOCAB, HIDDEN)
    for i in range(LAYERS):
        b = f"blk.{i}."
        out[b + "attn_norm.weight"] = norm(HIDDEN)
        out[b + "ffn_norm.weight"] = norm(HIDDEN)
        out[b + "attn_output.weight"] = w(HIDDEN, heads * head_dim)
        out[b + "ffn_down.weight"] = w(HIDDEN, INTERMEDIATE)
        if arch == "phi3":  # fused q/k/v and gate/up
            out[b + "attn_qkv.weight"] = w((heads + 2 * kv_heads) * head_dim, HIDDEN)
            out[b + "ffn_up.weight"] = w(2 * INTERMEDIATE, HIDDEN)
            continue
        out[b + "attn_q.weight"] = w(heads * head_dim, HIDDEN)
        out[b + "attn_k.weight"] = w(kv_heads * head_dim, HIDDEN)
        out[b + "attn_v.weight"] = w(kv_heads * head_dim, HIDDEN)
        out[b + "ffn_gate.weight"] = w(INTERMEDIATE, HIDDEN)
        out[b + "ffn_up.weight"] = w(INTERMEDIATE, HIDDEN)
        if arch == "qwen2":
            for p, n in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
                out[b + f"attn_{p}.bias"] = (0.1 * rng.standard_normal(n * head_dim)).astype(np.float32)
        if arch in ("qwen3", "gemma3"):
            out[b + "attn_q_norm.weight"] = norm(head_dim)
            out[b + "attn_k_norm.weight"] = norm(head_dim)
        if arch == "gemma3":
            out[b + "post_attention_norm.weight"] = norm(HIDDEN)
            out[b + "post_ffw_norm.weight"] = norm(HIDDEN)
    return out


def write_gguf(path: str, arch: str = "llama", *, qtype=T.F32, tied: bool = False, seed: int = 0,
               split_max_tensors: int = 0, name: str = "tiny", tensors: dict[str, np.ndarray] | None = None,
               metadata: dict | None = None) -> str:
    """A tiny GGUF of ``arch`` at ``path``: 2-D weights stored as ``qtype`` (norms and biases F32, as
    llama.cpp keeps them), a byte-level BPE tokenizer with a ChatML template. ``metadata``: keys to drop
    (None) or to set (a ``gguf.GGUFValue``), last. Returns the path written (the first shard's, when split)."""
    heads, kv_heads, head_dim = SHAPES[arch]
    writer = gguf.GGUFWriter(path, arch, split_max_tensors=split_max_tensors)
    writer.add_name(name)
    writer.add_block_count(LAYERS)
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(VOCAB)
    if arch == "gemma3":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_sliding_window(16)
    tokens, types, merges = _vocab()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokens.index("<|im_start|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_pad_token_id(tokens.index("<|endoftext|>"))
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    for tensor_name, values in (tensors or _tensors(arch, tied, np.random.default_rng(seed))).items():
        if values.ndim == 1 or qtype == T.F32:
            writer.add_tensor(tensor_name, values)
        elif qtype == T.F16:
            writer.add_tensor(tensor_name, values.astype(np.float16))
        else:
            writer.add_tensor(tensor_name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
    for key, value in (metadata or {}).items():
        if value is None:
            writer.kv_data[0].pop(key)
        else:
            writer.kv_data[0][key] = value
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if split_max_tensors:
        stem = path[: -len(".gguf")]
        return next(p for p in (f"{stem}-00001-of-{n:05d}.gguf" for n in range(2, 100)) if os.path.exists(p))
    return path


def prompts(n: int = 5, seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(0, VOCAB - len(SPECIAL_TOKENS)) for _ in range(length)] for length in (1, 5, 17, 33, 9)[:n]]


def hf_greedy_gguf(path: str, batch: list[list[int]], max_new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    """transformers' greedy tokens from the same file (its GGUF loader dequantizes to float32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 dtype=torch.float32).eval()
    outs = []
    with torch.inference_mode():
        for ids in batch:
            x = torch.tensor([ids])
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, do_sample=False,
                               eos_token_id=None, pad_token_id=0)
            outs.append(y[0, len(ids):].tolist())
    return outs


def halserve_greedy(model: str, batch: list[list[int]], max_new_tokens: int = NEW_TOKENS, **kwargs) -> list[list[int]]:
    """halserve's greedy tokens, dequantized at load unless ``quantization`` says otherwise: these tests check
    loading against transformers' float model (the GGUF kernels: test_gguf_quantized.py)."""
    from halserve import LLM, SamplingParams

    kwargs.setdefault("quantization", "unquantized")

    llm = LLM(model, platform="cpu", dtype="float32", max_model_len=128, block_size=16, num_kv_blocks=64, **kwargs)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]
    finally:
        llm.llm_engine.shutdown()


CASES = {  # id -> (GGUF architecture, weight type, tied embeddings, general.name, architecture halserve builds)
    "llama-f32": ("llama", T.F32, False, "tiny", "LlamaForCausalLM"),
    "llama-q8_0-tied": ("llama", T.Q8_0, True, "tiny", "LlamaForCausalLM"),
    "llama-q4_1": ("llama", T.Q4_1, False, "tiny", "LlamaForCausalLM"),
    # llama.cpp writes Mistral as llama; transformers tells them apart by the name
    "mistral-q8_0": ("llama", T.Q8_0, False, "mistral", "MistralForCausalLM"),
    "qwen2-f16-tied": ("qwen2", T.F16, True, "tiny", "Qwen2ForCausalLM"),
    "qwen2-q8_0": ("qwen2", T.Q8_0, False, "tiny", "Qwen2ForCausalLM"),
    "qwen3-q8_0": ("qwen3", T.Q8_0, False, "tiny", "Qwen3ForCausalLM"),
    "gemma3-f32-tied": ("gemma3", T.F32, True, "tiny", "Gemma3ForCausalLM"),
    "phi3-q8_0": ("phi3", T.Q8_0, False, "tiny", "Phi3ForCausalLM"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_matches_transformers_reading_the_same_file(case, tmp_path):
    arch, qtype, tied, name, architecture = CASES[case]
    path = write_gguf(str(tmp_path / f"{case}.gguf"), arch, qtype=qtype, tied=tied, name=name)
    assert _model_info(path).architecture == architecture
    reference = path
    if name == "mistral":  # transformers 5 cannot load a Mistral GGUF (its name map has no "mistral"): read the
        # same weights as Llama (one model without a sliding window) for the reference
        reference = write_gguf(str(tmp_path / "as-llama.gguf"), arch, qtype=qtype, tied=tied)
    batch = prompts()
    assert halserve_greedy(path, batch) == hf_greedy_gguf(reference, batch), case


def test_model_info_tokenizer_and_chat_template_come_from_the_metadata(tmp_path):
    from halserve.config import EngineConfig
    from halserve.engine.llm_engine import load_tokenizer
    from halserve.models.loader import get_model_info
    from halserve.platforms.cpu import CpuPlatform

    path = write_gguf(str(tmp_path / "m.gguf"), "qwen2", qtype=T.Q8_0)
    config = EngineConfig(model=str(tmp_path), dtype="float32")  # the folder holding the one GGUF
    info = get_model_info(config, CpuPlatform())
    assert (info.architecture, info.gguf_file, info.model_path) == ("Qwen2ForCausalLM", path, str(tmp_path))
    assert (info.num_layers, info.hidden_size, info.num_heads, info.num_kv_heads) == (LAYERS, HIDDEN, 4, 2)
    assert info.max_model_len == CONTEXT and info.vocab_size == VOCAB
    tokenizer = load_tokenizer(config, info)
    assert info.eos_token_ids == [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer("<|im_start|>a tie").input_ids
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>") and tokenizer.decode(ids) == "<|im_start|>a tie"


def test_split_files_load_like_the_single_file(tmp_path):
    (tmp_path / "whole").mkdir()
    (tmp_path / "split").mkdir()
    whole = write_gguf(str(tmp_path / "whole" / "m.gguf"), "llama", qtype=T.Q8_0)
    first = write_gguf(str(tmp_path / "split" / "m.gguf"), "llama", qtype=T.Q8_0, split_max_tensors=8)
    assert first.endswith("-00001-of-00003.gguf"), sorted(os.listdir(tmp_path / "split"))
    batch = prompts(3)
    expected = hf_greedy_gguf(whole, batch)
    assert halserve_greedy(first, batch) == expected
    assert halserve_greedy(str(tmp_path / "split"), batch) == expected  # the folder holding the split set
    os.remove(first.replace("-00001-", "-00002-"))
    with pytest.raises(ValueError, match=r"m-00002-of-00003\.gguf is missing"):
        halserve_greedy(first, batch)


def test_tokenizer_and_hf_config_path_overrides(tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    path = write_gguf(str(tmp_path / "m.gguf"), "llama", qtype=T.Q8_0)
    # a config.json and tokenizer saved from the file itself, in other folders: same model, same tokens
    config = AutoConfig.from_pretrained(str(tmp_path), gguf_file="m.gguf")
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(str(tmp_path / "config"))
    AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="m.gguf").save_pretrained(str(tmp_path / "tok"))
    batch = prompts(3)
    expected = hf_greedy_gguf(path, batch)
    assert halserve_greedy(path, batch, tokenizer=str(tmp_path / "tok"),
                           hf_config_path=str(tmp_path / "config")) == expected
    # the config really comes from there: a different depth no longer fits the file
    config.num_hidden_layers = 1
    config.save_pretrained(str(tmp_path / "config1"))
    with pytest.raises(ValueError, match=r"GGUF tensors blk\.1\..* have no counterpart .*llama, 1 layers"):
        halserve_greedy(path, batch, hf_config_path=str(tmp_path / "config1"))


def _model_info(model: str, **config):
    from halserve.config import EngineConfig
    from halserve.models.loader import get_model_info
    from halserve.platforms.cpu import CpuPlatform

    return get_model_info(EngineConfig(model=model, dtype="float32", **config), CpuPlatform())


def test_unsupported_architecture_is_named_with_the_supported_ones(tmp_path):
    tensors = _tensors("llama", False, np.random.default_rng(0))
    path = str(tmp_path / "m.gguf")
    writer = gguf.GGUFWriter(path, "falcon")
    writer.add_block_count(LAYERS)
    for name, values in tensors.items():
        writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"GGUF architecture 'falcon' .* not supported.*llama.*qwen2.*qwen3"):
        _model_info(path)


def test_unsupported_tensor_type_is_named_with_the_supported_ones(tmp_path):
    tensors = _tensors("llama", False, np.random.default_rng(0))
    # Q8_K: llama.cpp's dot-product intermediate, which the gguf package cannot dequantize
    size, block_bytes = gguf.GGML_QUANT_SIZES[T.Q8_K]
    q8k = np.zeros((VOCAB, HIDDEN * 4 // size * block_bytes), dtype=np.uint8)
    tensors["token_embd.weight"] = q8k
    path = str(tmp_path / "m.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    for name, values in tensors.items():
        writer.add_tensor(name, values, raw_dtype=T.Q8_K if name == "token_embd.weight" else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"'token_embd.weight' .* GGUF type Q8_K.*supported types: F32, F16, Q4_0"):
        _model_info(path)


def _cut_points(path: str) -> dict[str, int]:
    """Where to cut ``path`` to end it inside each part of a GGUF: section -> bytes kept."""
    reader = gguf.GGUFReader(path)
    return {"header": 20, "metadata": 100, "tensor table": reader.tensors[0].field.offset + 4,
            "tensor data": os.path.getsize(path) - 10}


@pytest.mark.parametrize("section", ["header", "metadata", "tensor table", "tensor data"])
def test_truncated_file_fails_clearly(tmp_path, section):
    path = write_gguf(str(tmp_path / "m.gguf"), "llama", qtype=T.Q8_0)
    with open(path, "rb") as f:
        data = f.read()
    keep = _cut_points(path)[section]
    with open(path, "wb") as f:
        f.write(data[:keep])
    tensor = r"tensor 'blk\.1\.ffn_up\.weight' ends at byte \d+" if section == "tensor data" else r"reading it needs"
    with pytest.raises(ValueError, match=rf"m\.gguf' is truncated in its {section}: {tensor} .*download or convert"):
        _model_info(path)


def test_a_gguf_release_whose_private_reader_methods_changed_still_reads_a_sound_file(tmp_path, monkeypatch):
    # the bounds checks override gguf.GGUFReader's private methods; if a release changes them, a sound file must
    # still load through the plain reader, and a damaged one still fail with a message naming it
    from halserve.models.gguf import read_file

    class ChangedApi(gguf.GGUFReader):
        def _build_tensors(self, *args, **kwargs):
            raise TypeError("_build_tensors() takes 2 positional arguments but 3 were given")

    monkeypatch.setattr(read_file, "_checked_reader_class", lambda: ChangedApi)
    path = write_gguf(str(tmp_path / "m.gguf"), "llama", qtype=T.Q8_0)
    reader = read_file.read_gguf_file(path)
    assert [t.name for t in reader.tensors] == [t.name for t in gguf.GGUFReader(path).tensors]
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[:100])
    with pytest.raises(ValueError, match=r"m\.gguf' is not a readable GGUF file \(truncated or corrupt\?\)"):
        read_file.read_gguf_file(path)


@pytest.mark.parametrize("content, message", [
    (b"", r"empty\.gguf' is empty \(0 bytes\), not a GGUF model.*download or convert it again"),
    (b"GG", r"empty\.gguf' is truncated: it has 2 bytes, fewer than a GGUF header"),
    (b"hello, not a model\n", r"is not a GGUF file: it starts with b'hell', not GGUF's magic b'GGUF'"),
    (b"version https://git-lfs.github.com/spec/v1\noid sha256:00\nsize 9\n", r"a Git LFS pointer.*git lfs pull"),
])
def test_a_file_that_is_not_gguf_is_named(tmp_path, content, message):
    path = tmp_path / "empty.gguf"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=message):
        _model_info(str(path))
    with pytest.raises(ValueError, match=message):  # the same as a folder's one GGUF
        _model_info(str(tmp_path))


def test_unknown_gguf_version_and_tensor_type_number_are_named(tmp_path):
    path = write_gguf(str(tmp_path / "m.gguf"), "llama", qtype=T.Q8_0)
    data = bytearray(open(path, "rb").read())
    field = gguf.GGUFReader(path).tensors[0].field  # token_embd.weight: name length, name, n_dims, dims, type
    type_at = field.offset + 8 + len(bytes(field.parts[1])) + 4 + 8 * int(field.parts[2][0])
    assert int.from_bytes(data[type_at:type_at + 4], "little") == T.Q8_0
    data[type_at:type_at + 4] = (99).to_bytes(4, "little")
    (tmp_path / "t.gguf").write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"tensor 'token_embd\.weight' of .*t\.gguf' has GGUF type number 99, which the "
                                         r"installed gguf package does not know.*pip install -U gguf.*Q4_0"):
        _model_info(str(tmp_path / "t.gguf"))
    data[4:8] = (4).to_bytes(4, "little")
    (tmp_path / "v.gguf").write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"v\.gguf' is GGUF version 4, which the installed gguf package cannot read "
                                         r"\(it reads versions 2, 3\)"):
        _model_info(str(tmp_path / "v.gguf"))


def test_missing_architecture_is_named(tmp_path):
    path = write_gguf(str(tmp_path / "m.gguf"), metadata={"general.architecture": None})
    with pytest.raises(ValueError, match=r"'m\.gguf' has no general\.architecture in its metadata.*convert_hf_to_gguf"
                                         r".*llama \(Llama, Mistral, SmolLM\)"):
        _model_info(path)


V = gguf.GGUFValueType


@pytest.mark.parametrize("key, value, message", [
    ("llama.context_length", None, "llama.context_length is missing"),
    ("llama.embedding_length", None, "llama.embedding_length is missing"),
    ("llama.block_count", None, "llama.block_count is missing"),
    ("llama.attention.head_count", None, "llama.attention.head_count is missing"),
    ("llama.context_length", gguf.GGUFValue(0, V.UINT32), "llama.context_length is 0, not a positive integer"),
    ("llama.context_length", gguf.GGUFValue("big", V.STRING), "llama.context_length is 'big', not a positive"),
    ("llama.attention.layer_norm_rms_epsilon", None, "llama.attention.layer_norm_rms_epsilon is missing"),
    ("llama.attention.layer_norm_rms_epsilon", gguf.GGUFValue(-1.0, V.FLOAT32),
     r"llama.attention.layer_norm_rms_epsilon is -1.0, not a small positive number"),
])
def test_metadata_the_config_needs_is_checked(tmp_path, key, value, message):
    """transformers fills a missing key with its own default (a 4096 hidden size, 32 layers ...): refused with
    the key's name instead of a shape error later (or a silent context length)."""
    path = write_gguf(str(tmp_path / "m.gguf"), metadata={key: value})
    with pytest.raises(ValueError, match=rf"the metadata of 'm\.gguf' cannot describe its model: {message}.*"
                                         r"convert it again.*--hf-config-path"):
        _model_info(path)


def test_metadata_transformers_rejects_is_reported_with_the_file(tmp_path):
    path = write_gguf(str(tmp_path / "m.gguf"), metadata={"llama.attention.head_count": gguf.GGUFValue(3, V.UINT32)})
    with pytest.raises(ValueError, match=r"the metadata of 'm\.gguf' does not make a llama config \(.*not a multiple "
                                         r"of the number of attention heads \(3\).*--hf-config-path"):
        _model_info(path)


TOKENIZER_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                  "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                  "tokenizer.ggml.padding_token_id", "tokenizer.ggml.add_bos_token", "tokenizer.chat_template")


@pytest.mark.parametrize("metadata, message", [
    ({k: None for k in TOKENIZER_KEYS}, r"'m\.gguf' holds no tokenizer: tokenizer\.ggml\.model and "
                                        r"tokenizer\.ggml\.tokens are missing from its metadata"),
    ({"tokenizer.ggml.tokens": None}, r"'m\.gguf' holds no tokenizer: tokenizer\.ggml\.tokens is missing"),
    ({"tokenizer.ggml.merges": None}, r"neither tokenizer\.ggml\.merges nor tokenizer\.ggml\.scores"),
    ({"tokenizer.ggml.eos_token_id": gguf.GGUFValue(5000, V.UINT32)},
     rf"tokenizer\.ggml\.eos_token_id of 'm\.gguf' is 5000, not a token of its {VOCAB}-token vocabulary"),
])
def test_tokenizer_metadata_is_checked_before_loading(tmp_path, metadata, message):
    """transformers' KeyError / IndexError / "Cannot build a tokenizer" become one message naming the key, at
    start (before the weights load), with the --tokenizer way out; with --tokenizer the file's is not needed."""
    from halserve.models.gguf import load_gguf_tokenizer

    path = write_gguf(str(tmp_path / "m.gguf"), metadata=metadata)
    with pytest.raises(ValueError, match=message + r".*pass --tokenizer"):
        _model_info(path)
    with pytest.raises(ValueError, match=message):
        load_gguf_tokenizer(path)
    _model_info(path, tokenizer=write_gguf(str(tmp_path / "tok.gguf")))


def test_split_set_with_a_shard_of_another_model_or_a_copied_shard(tmp_path):
    import shutil

    for name in ("a", "b", "mixed", "copied"):
        (tmp_path / name).mkdir()
    first = write_gguf(str(tmp_path / "a" / "m.gguf"), "llama", qtype=T.Q8_0, split_max_tensors=8)
    assert first.endswith("-00001-of-00003.gguf")
    other = write_gguf(str(tmp_path / "b" / "m.gguf"), "qwen2", qtype=T.Q8_0, split_max_tensors=8)
    assert other.endswith("-00001-of-00004.gguf")
    for i in (1, 3):
        shutil.copy(str(tmp_path / "a" / f"m-0000{i}-of-00003.gguf"), str(tmp_path / "mixed"))
    shutil.copy(str(tmp_path / "b" / "m-00002-of-00004.gguf"), str(tmp_path / "mixed" / "m-00002-of-00003.gguf"))
    with pytest.raises(ValueError, match=r"'m-00002-of-00003\.gguf' belongs to a split set of 4 files \(split\.count\) "
                                         r"but 'm-00001-of-00003\.gguf' starts a set of 3.*download the split set again"):
        _model_info(str(tmp_path / "mixed"))
    for i, source in ((1, 1), (2, 1), (3, 3)):  # shard 2 a copy of shard 1
        shutil.copy(str(tmp_path / "a" / f"m-0000{source}-of-00003.gguf"),
                    str(tmp_path / "copied" / f"m-0000{i}-of-00003.gguf"))
    with pytest.raises(ValueError, match=r"'m-00002-of-00003\.gguf' is shard 1 of its set \(split\.no\), not shard 2"):
        _model_info(str(tmp_path / "copied"))


def _first_weight(path: str, hf_config_path: str | None = None):
    """What loading the weights raises first (it checks every tensor before yielding one)."""
    from halserve.models.gguf import iterate_gguf_weights, load_gguf_config

    return next(iterate_gguf_weights(path, load_gguf_config(path, hf_config_path), torch.float32))


@pytest.mark.parametrize("qtype", [T.Q8_0, T.F32])
def test_tensor_shapes_that_disagree_with_the_config_are_named(tmp_path, qtype):
    """Before: a shape error from deep in a layer (in GGUF block bytes: (64, 102) for (64, 96)), or with F32
    a RuntimeError from narrow(); now the tensor, both shapes and the file, before any weight is read."""
    tensors = _tensors("llama", False, np.random.default_rng(0))
    tensors["blk.0.ffn_down.weight"] = tensors["blk.0.ffn_down.weight"][:, :96].copy()
    path = write_gguf(str(tmp_path / "ffn.gguf"), qtype=qtype, tensors=tensors)
    with pytest.raises(ValueError, match=r"GGUF tensor 'blk\.0\.ffn_down\.weight' of ffn\.gguf .* has shape \[64, 96\], "
                                         r"but the config .* needs \[64, 128\] for model\.layers\.0\.mlp\.down_proj"):
        _first_weight(path)
    wide = write_gguf(str(tmp_path / "wide.gguf"), metadata={"llama.embedding_length": gguf.GGUFValue(96, V.UINT32)})
    with pytest.raises(ValueError, match=r"'token_embd\.weight' of wide\.gguf .* has shape \[308, 64\], but the config "
                                         r"\(llama, hidden_size 96\) needs \[308, 96\].*convert it again"):
        _first_weight(wide)
    deep = write_gguf(str(tmp_path / "deep.gguf"), metadata={"llama.block_count": gguf.GGUFValue(5, V.UINT32)})
    with pytest.raises(ValueError, match=r"deep\.gguf .* has tensors for 2 layers \(blk\.N\) but the config says 5 "
                                         r"\(num_hidden_layers; blk\.2 is missing\)"):
        _first_weight(deep)


def test_override_paths_that_are_missing_or_of_another_model(tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    from halserve.config import EngineConfig
    from halserve.engine.llm_engine import load_tokenizer

    path = write_gguf(str(tmp_path / "m.gguf"), "llama", qtype=T.Q8_0)
    for flag in ("tokenizer", "hf_config_path"):  # before: transformers' "Repo id must be in the form ..."
        with pytest.raises(ValueError, match=rf"no such file or directory: .*nope \(the --{flag.replace('_', '-')} "
                                             r"argument is a local path"):
            _model_info(path, **{flag: str(tmp_path / "nope")})
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"--hf-config-path '.*empty' holds no usable config\.json"):
        _model_info(path, hf_config_path=str(tmp_path / "empty"))
    with pytest.raises(ValueError, match=r"--hf-config-path '.*m\.gguf' is a GGUF file; it takes a folder"):
        _model_info(path, hf_config_path=path)
    # another model's config: its sizes do not fit the file's tensors
    config = AutoConfig.from_pretrained(str(tmp_path), gguf_file="m.gguf")
    config.architectures, config.hidden_size = ["LlamaForCausalLM"], 2 * HIDDEN
    config.save_pretrained(str(tmp_path / "other"))
    with pytest.raises(ValueError, match=r"'token_embd\.weight' of m\.gguf .* has shape \[308, 64\], but the config "
                                         r"\(llama, hidden_size 128\) needs \[308, 128\].*is it this model's config"):
        _first_weight(path, str(tmp_path / "other"))
    # a tokenizer folder with nothing in it, and another model's larger tokenizer (before: an IndexError mid-step)
    info = _model_info(path)
    with pytest.raises(ValueError, match=r"--tokenizer '.*empty' holds no tokenizer transformers can load"):
        load_tokenizer(EngineConfig(model=path, tokenizer=str(tmp_path / "empty")), info)
    bigger = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="m.gguf")
    bigger.add_tokens([f"extra{i}" for i in range(8)])
    bigger.save_pretrained(str(tmp_path / "bigger"))
    with pytest.raises(ValueError, match=rf"--tokenizer '.*bigger' has {VOCAB + 8} tokens but the model's vocabulary "
                                         rf"\(its embedding\) has {VOCAB}: it is not this model's tokenizer"):
        load_tokenizer(EngineConfig(model=path, tokenizer=str(tmp_path / "bigger")), info)


def test_a_prompt_holding_a_token_the_model_lacks_is_refused(tmp_path):
    """transformers gives a Gemma GGUF's tokenizer a ``<mask>`` token when the vocabulary has none: one id past
    the embedding. Before: an IndexError in the model's step (failing every request in it); now the request is
    refused with the token's name, and the rest of the prompt tokenizes as before."""
    from halserve.config import EngineConfig
    from halserve.engine.llm_engine import load_tokenizer
    from halserve.engine.processor import InputProcessor

    path = write_gguf(str(tmp_path / "g.gguf"), "gemma3", tied=True)
    info = _model_info(path)
    tokenizer = load_tokenizer(EngineConfig(model=path, dtype="float32"), info)
    assert len(tokenizer) == VOCAB + 1 and tokenizer.convert_tokens_to_ids("<mask>") == VOCAB
    processor = InputProcessor(info, tokenizer)
    with pytest.raises(ValueError, match=rf"the prompt holds the token '<mask>' \(id {VOCAB}\), which the model's "
                                         rf"vocabulary of {VOCAB} tokens lacks"):
        processor.tokenize("a <mask> tie")
    assert processor.tokenize("a tie")[1] == tokenizer.encode("a tie")


def test_missing_path_and_ambiguous_folder(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"no such file or directory: .*nope\.gguf"):
        _model_info(str(tmp_path / "nope.gguf"))
    monkeypatch.chdir(tmp_path)  # a bare file name is no hub id either
    with pytest.raises(ValueError, match=r"GGUF file 'nope\.gguf' does not exist"):
        _model_info("nope.gguf")
    write_gguf(str(tmp_path / "a.gguf"), "llama")
    write_gguf(str(tmp_path / "b.gguf"), "llama")
    with pytest.raises(ValueError, match=r"holds several GGUF models \(a\.gguf, b\.gguf\)"):
        _model_info(str(tmp_path))


def test_the_converted_config_and_tokenizer_are_kept_and_load_the_same(tmp_path, monkeypatch):
    """The config and tokenizer transformers converts from a GGUF's metadata are saved once per file; the next
    load reads those copies (transformers does not parse the file again) and the tokenizer tokenizes, decodes
    and applies the chat template exactly as the conversion did, the config has the same fields; a damaged
    copy is converted again; ``HALSERVE_GGUF_CACHE=off`` keeps nothing."""
    from transformers import AutoConfig, AutoTokenizer

    from halserve.models.gguf import reader

    monkeypatch.setenv(reader.CACHE_ENV, str(tmp_path / "cache"))
    path = write_gguf(str(tmp_path / "m.gguf"), "llama", qtype=T.Q8_0)
    fresh, fresh_config = reader.load_gguf_tokenizer(path), reader.load_gguf_config(path)
    folder = reader.converted_cache_dir(path)
    assert folder.startswith(str(tmp_path / "cache"))
    assert os.path.isfile(os.path.join(folder, "tokenizer", "tokenizer.json"))
    assert os.path.isfile(os.path.join(folder, "config", "config.json"))

    def from_folder_only(load):
        def checked(name, *args, **kwargs):
            assert "gguf_file" not in kwargs, "transformers was asked to parse the GGUF again"
            return load(name, *args, **kwargs)
        return checked

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", from_folder_only(AutoTokenizer.from_pretrained))
    monkeypatch.setattr(AutoConfig, "from_pretrained", from_folder_only(AutoConfig.from_pretrained))
    kept, kept_config = reader.load_gguf_tokenizer(path), reader.load_gguf_config(path)
    assert type(kept) is type(fresh) and kept.get_vocab() == fresh.get_vocab()
    for text in ("a tie", "<|im_start|>user\nhi<|im_end|>", "  two  spaces ", "ünïcode and 123", ""):
        assert kept(text).input_ids == fresh(text).input_ids, text
        assert kept.decode(fresh(text).input_ids) == fresh.decode(fresh(text).input_ids)
    messages = [{"role": "user", "content": "hi"}]
    assert (kept.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            == fresh.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    assert (kept.bos_token, kept.eos_token, kept.pad_token, kept.unk_token) == (
        fresh.bos_token, fresh.eos_token, fresh.pad_token, fresh.unk_token)
    assert kept.all_special_ids == fresh.all_special_ids
    assert type(kept_config) is type(fresh_config)
    drop = ("_name_or_path", "transformers_version")
    assert ({k: v for k, v in kept_config.to_dict().items() if k not in drop}
            == {k: v for k, v in fresh_config.to_dict().items() if k not in drop})

    monkeypatch.undo()
    monkeypatch.setenv(reader.CACHE_ENV, str(tmp_path / "cache"))
    with open(os.path.join(folder, "tokenizer", "tokenizer.json"), "w") as f:
        f.write("{not json")
    again = reader.load_gguf_tokenizer(path)  # (a warning, then converted again and saved anew)
    assert again.get_vocab() == fresh.get_vocab()
    assert reader.load_gguf_tokenizer(path).get_vocab() == fresh.get_vocab()

    monkeypatch.setenv(reader.CACHE_ENV, "off")
    assert reader.converted_cache_dir(path) is None
