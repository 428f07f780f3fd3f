"""Tiny random-weight LLaVA checkpoints (HF format) for the multimodal tests, fully offline.

    from mm_factory import make_llava_checkpoint, make_image
    path = make_llava_checkpoint(tmp_path)
    LlavaForConditionalGeneration.from_pretrained(path); AutoProcessor.from_pretrained(path)

``make_llava_checkpoint(tmp_dir, *, text_arch="llama", image_size=56, patch_size=14, seed=0,
vision_feature_select_strategy="default", vision_feature_layer=-2, **text_overrides) -> str`` writes:

- ``config.json`` + ``model.safetensors``: ``LlavaForConditionalGeneration`` (transformers' own
  class, so the tensor names are the ones transformers writes), float32, randomised like
  ``model_factory`` (spread-out logits); the text model is ``model_factory``'s tiny decoder
  (vocabulary 512 with ``<image>`` as its last added token), the vision tower a 2-layer CLIP ViT
  (hidden 32) on ``image_size``-pixel images in ``patch_size`` patches, so an image is
  ``(image_size // patch_size) ** 2`` placeholder tokens (+1 with strategy ``"full"``);
- the tokenizer (``model_factory.make_tokenizer``) whose chat template renders content parts
  ``{"type": "image"}`` as ``<image>``, a ``CLIPImageProcessor`` and a ``LlavaProcessor``
  (``preprocessor_config.json``, ``processor_config.json``), as llava-hf checkpoints ship them.

``make_image(seed, size=(40, 30))`` is a random RGB ``PIL.Image``; ``image_data_url(image)`` its
``data:image/png;base64,...`` URL.
"""
from __future__ import annotations

import base64
import io
import math
import os

import torch

from model_factory import _hf_config, _randomize, make_tokenizer

IMAGE_TOKEN = "<image>"
VOCAB_SIZE = 512
LLAVA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}<image>\n"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ eos_token }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def make_llava_checkpoint(tmp_dir, *, text_arch: str = "llama", image_size: int = 56, patch_size: int = 14,
                          seed: int = 0, vision_feature_select_strategy: str = "default",
                          vision_feature_layer: int | list[int] = -2, num_layers: int = 2,
                          **text_overrides) -> str:
    import transformers
    from transformers import CLIPImageProcessor, CLIPVisionConfig, GenerationConfig, LlavaConfig, LlavaProcessor

    path = os.fspath(tmp_dir)
    os.makedirs(path, exist_ok=True)
    tokenizer = make_tokenizer(VOCAB_SIZE, seed, added_tokens=(IMAGE_TOKEN,))
    tokenizer.chat_template = LLAVA_CHAT_TEMPLATE
    image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    text_config = _hf_config(
        text_arch, vocab_size=VOCAB_SIZE, hidden_size=64, num_layers=num_layers, num_heads=4, num_kv_heads=2,
        head_dim=None, intermediate_size=128, max_position_embeddings=512, tie_word_embeddings=False,
        rope_scaling=None, sliding_window=None, overrides=dict(text_overrides),
    )
    vision_config = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=2, image_size=image_size, patch_size=patch_size,
                                     projection_dim=32, hidden_act="quick_gelu", layer_norm_eps=1e-5)
    num_patches = (image_size // patch_size) ** 2
    config = LlavaConfig(vision_config=vision_config, text_config=text_config, image_token_index=image_token_id,
                         image_seq_length=num_patches + (vision_feature_select_strategy == "full"),
                         projector_hidden_act="gelu", vision_feature_select_strategy=vision_feature_select_strategy,
                         vision_feature_layer=vision_feature_layer)
    config.architectures = ["LlavaForConditionalGeneration"]
    config.dtype = "float32"
    torch.manual_seed(seed)
    model = transformers.LlavaForConditionalGeneration(config).to(torch.float32)
    _randomize(model, 64, seed)
    with torch.no_grad():  # the vision tower's hidden size is 32: its weights at 1/sqrt(32)
        for name, param in model.named_parameters():
            if "vision_tower" in name and param.dim() >= 2 and "embedding" not in name:
                param.mul_(math.sqrt(64 / 32))
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model.save_pretrained(path, safe_serialization=True)
    image_processor = CLIPImageProcessor(size={"shortest_edge": image_size},
                                         crop_size={"height": image_size, "width": image_size})
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=patch_size,
                               vision_feature_select_strategy=vision_feature_select_strategy,
                               chat_template=LLAVA_CHAT_TEMPLATE,
                               num_additional_image_tokens=1)
    processor.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def make_image(seed: int, size: tuple[int, int] = (40, 30)):
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8), "RGB")


def image_data_url(image, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64,{base64.b64encode(buf.getvalue()).decode()}"
