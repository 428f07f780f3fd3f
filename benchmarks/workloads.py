"""The throughput workloads of BENCHMARKS.md: random-weight Llama checkpoints, vocab 8192.

    W1: hidden 768, 12 layers, 12 heads, 4 KV heads, intermediate 2048 (~88M params);
        64 prompts x 128 random tokens, 128 output tokens each.
    W2: hidden 256, 4 layers, 4 heads, 2 KV heads, intermediate 512 (~6.5M params);
        256 prompts x 32 tokens, 64 output tokens each.

the real-model workload (``REAL_WORKLOADS``):

    SmolLM2: SmolLM2-135M-Instruct (a real chat model, Apache-2.0), from the Q4_1 GGUF that
        ``scripts/get_smollm2.sh`` fetches, dequantized by transformers and saved as a float32
        HF folder (so that every server reads the same float weights);
        128 prompts x 128 random tokens, 128 output tokens each.

and the image workload (``MM_WORKLOADS``, run by ``benchmarks/mm_throughput.py``):

    V1: LLaVA (transformers' ``LlavaForConditionalGeneration``): W1's decoder (vocabulary 8192, the
        last id ``<image>``) behind a CLIP ViT-B/16 at 224 px (hidden 768, 12 layers, 12 heads,
        intermediate 3072; feature layer -2, strategy "default": 14 x 14 = 196 placeholder tokens
        an image) and a 2-layer projector (~175M params, float32);
        64 prompts x (one random RGB image of 200-400 px sides + 32 random words around one
        ``<image>``), 64 output tokens each.

``python benchmarks/workloads.py DIR [NAME ...]`` writes the checkpoints (default W1 and W2; each
with a WordLevel tokenizer of the same vocabulary, so every server can load them; V1 also with a
``CLIPImageProcessor``, a ``LlavaProcessor`` and ``LLAVA_CHAT_TEMPLATE``, so that servers answer chat
requests with images) under DIR.
"""
from __future__ import annotations

import os
import sys

WORKLOADS = {
    "W1": dict(
        model=dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                   intermediate_size=2048),
        num_prompts=64, input_len=128, output_len=128,
    ),
    "W2": dict(
        model=dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                   intermediate_size=512),
        num_prompts=256, input_len=32, output_len=64,
    ),
}
REAL_WORKLOADS = {
    "SmolLM2": dict(gguf_script="scripts/get_smollm2.sh", num_prompts=128, input_len=128, output_len=128),
}
VOCAB = 8192
MM_WORKLOADS = {
    "V1": dict(
        model=WORKLOADS["W1"]["model"],
        vision=dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
                    image_size=224, patch_size=16),
        num_prompts=64, text_len=32, output_len=64, image_sides=(200, 400),
    ),
}
IMAGE_TOKEN = "<image>"
# V1's chat template (chat_template.jinja): no role markers (the vocabulary is words ``w<id>``), image
# parts as ``<image>\n`` (the processor expands each to the model's placeholder tokens), text as is.
LLAVA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}<image>\n"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '\\n' }}{% endfor %}"  # (a newline right after a block tag would be trimmed)
)


def _word_level_vocab(num_words: int) -> dict[str, int]:
    """``<unk>`` 0, ``<s>`` 1, ``</s>`` 2, then ``w3`` .. ``w{num_words - 1}`` (the word of id i is ``wi``)."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"w{i}": i for i in range(3, num_words)})
    return vocab


def ensure_checkpoint(name: str, root: str) -> str:
    path = os.path.join(root, name)
    if os.path.exists(os.path.join(path, "model.safetensors")):
        if name in MM_WORKLOADS:
            _ensure_chat_template(path)  # (checkpoints written before it had one: the weights stay)
        return path
    if name in MM_WORKLOADS:
        return _write_llava_checkpoint(name, path)
    if name in REAL_WORKLOADS:
        return _write_dequantized_gguf(REAL_WORKLOADS[name]["gguf_script"], path)
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, max_position_embeddings=2048, bos_token_id=1, eos_token_id=2,
                         tie_word_embeddings=False, dtype="float32", **WORKLOADS[name]["model"])
    model = LlamaForCausalLM(config)
    model.save_pretrained(path, safe_serialization=True)
    tok = Tokenizer(models.WordLevel(_word_level_vocab(VOCAB), unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(path)
    return path


def _write_dequantized_gguf(script: str, path: str) -> str:
    """The GGUF that ``script`` prints the path of, dequantized by transformers, as a float32 HF folder."""
    import subprocess

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    gguf = subprocess.run(["bash", os.path.join(repo, script)], check=True, capture_output=True,
                          text=True).stdout.strip().splitlines()[-1]
    folder, file = os.path.split(gguf)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32)
    # (a model loaded from a GGUF is marked quantized and refuses save_pretrained: copy it into a plain one)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(path, safe_serialization=True)
    AutoTokenizer.from_pretrained(folder, gguf_file=file).save_pretrained(path)
    return path


def _write_llava_checkpoint(name: str, path: str) -> str:
    """A random-weight LLaVA checkpoint as llava-hf ships them: model, WordLevel tokenizer with ``<image>``
    as its last id (an added special token, so a run of placeholders written back to back splits),
    ``CLIPImageProcessor`` (preprocessor_config.json) and ``LlavaProcessor`` (processor_config.json).
    Random weights as transformers initialises them (like W1's), seed 0."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
        PreTrainedTokenizerFast,
    )

    w = MM_WORKLOADS[name]
    tok = Tokenizer(models.WordLevel(_word_level_vocab(VOCAB - 1), unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([IMAGE_TOKEN])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = LLAVA_CHAT_TEMPLATE
    image_token_id = fast.convert_tokens_to_ids(IMAGE_TOKEN)
    assert image_token_id == VOCAB - 1 and len(fast) == VOCAB, (image_token_id, len(fast))
    text_config = LlamaConfig(vocab_size=VOCAB, max_position_embeddings=2048, bos_token_id=1, eos_token_id=2,
                              tie_word_embeddings=False, **w["model"])
    vision = w["vision"]
    vision_config = CLIPVisionConfig(projection_dim=512, hidden_act="quick_gelu", layer_norm_eps=1e-5, **vision)
    num_image_tokens = (vision["image_size"] // vision["patch_size"]) ** 2  # strategy "default": no CLS token
    config = LlavaConfig(vision_config=vision_config, text_config=text_config, image_token_index=image_token_id,
                         image_seq_length=num_image_tokens, projector_hidden_act="gelu",
                         vision_feature_select_strategy="default", vision_feature_layer=-2,
                         tie_word_embeddings=False)
    config.architectures = ["LlavaForConditionalGeneration"]
    config.dtype = "float32"
    size = vision["image_size"]
    image_processor = CLIPImageProcessor(size={"shortest_edge": size}, crop_size={"height": size, "width": size})
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=fast, patch_size=vision["patch_size"],
                               vision_feature_select_strategy="default", num_additional_image_tokens=1,
                               chat_template=LLAVA_CHAT_TEMPLATE)
    processor.save_pretrained(path)
    image_processor.save_pretrained(path)  # (also preprocessor_config.json, as llava-hf checkpoints ship it)
    fast.save_pretrained(path)
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config).to(torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    _use_hub_vision_names(os.path.join(path, "model.safetensors"))  # last: the file marks the checkpoint complete
    return path


def _ensure_chat_template(path: str) -> None:
    """Writes ``LLAVA_CHAT_TEMPLATE`` as ``chat_template.jinja`` (where transformers' tokenizer and processor
    both read it from) unless the checkpoint has a chat template already."""
    import json

    with open(os.path.join(path, "tokenizer_config.json"), encoding="utf-8") as f:
        has_template = "chat_template" in json.load(f)
    file = os.path.join(path, "chat_template.jinja")
    if has_template or os.path.exists(file):
        return
    with open(file + ".tmp", "w", encoding="utf-8") as f:
        f.write(LLAVA_CHAT_TEMPLATE)
    os.replace(file + ".tmp", file)


def _use_hub_vision_names(file: str) -> None:
    """transformers 5 saves the CLIP tower as ``vision_tower.embeddings.*``, ``vision_tower.encoder.*``;
    llava-hf's Hub checkpoints (and what vLLM 0.32 loads: "There is no module or parameter named
    'vision_tower.embeddings'") name it ``vision_tower.vision_model.*``, which transformers loads too.
    Rewrites ``file`` with the Hub's names."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(file)
    renamed = {(f"vision_tower.vision_model.{k.removeprefix('vision_tower.')}"
                if k.startswith("vision_tower.") and not k.startswith("vision_tower.vision_model.") else k): v
               for k, v in tensors.items()}
    os.remove(file)
    save_file(renamed, file, metadata={"format": "pt"})


if __name__ == "__main__":
    root = sys.argv[1] if len(sys.argv) > 1 else "bench_out/models"
    for name in sys.argv[2:] or list(WORKLOADS):
        print(name, ensure_checkpoint(name, root))
