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
               split_max_tensors: int = 0, name: str = "tiny", tensors: dict[str, np.ndarray] | None = None) -> str:
    """A tiny GGUF of ``arch`` at ``path``: 2-D weights stored as ``qtype`` (norms and biases F32, as
    llama.cpp keeps them), a byte-level BPE tokenizer with a ChatML template. Returns the path written
    (the first shard's, when split)."""
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


def _model_info(model: str):
    from halserve.config import EngineConfig
    from halserve.models.loader import get_model_info
    from halserve.platforms.cpu import CpuPlatform

    return get_model_info(EngineConfig(model=model, dtype="float32"), CpuPlatform())


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


@pytest.mark.parametrize("keep", [0.5, 0.01])  # cut in the tensor data / in the header
def test_truncated_file_fails_clearly(tmp_path, keep):
    path = write_gguf(str(tmp_path / "m.gguf"), "llama", qtype=T.Q8_0)
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[: int(len(data) * keep)])
    with pytest.raises(ValueError, match=r"(is truncated|not a readable GGUF file \(truncated or corrupt\?\))"):
        _model_info(path)


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
