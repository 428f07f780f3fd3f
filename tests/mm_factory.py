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
    from transformers import CLIPImageProcessor, CLIPVisionConfig, LlavaConfig, LlavaProcessor

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
    _save_random_model(transformers.LlavaForConditionalGeneration, config, path, seed, _clip_tower_scale)
    image_processor = CLIPImageProcessor(size={"shortest_edge": image_size},
                                         crop_size={"height": image_size, "width": image_size})
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=patch_size,
                               vision_feature_select_strategy=vision_feature_select_strategy,
                               chat_template=LLAVA_CHAT_TEMPLATE,
                               num_additional_image_tokens=1)
    processor.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _save_random_model(model_cls, config, path: str, seed: int, rescale_vision) -> None:
    """``model_cls(config)`` seeded and randomised like ``model_factory`` (at the decoder's width, 64), its
    vision weights then adjusted by ``rescale_vision(name, param)``, saved to ``path`` with eos 2."""
    from transformers import GenerationConfig

    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    _randomize(model, 64, seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            rescale_vision(name, param)
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model.save_pretrained(path, safe_serialization=True)


def _clip_tower_scale(name: str, param: torch.Tensor) -> None:
    """The CLIP tower's hidden size is 32: its matrices at 1/sqrt(32)."""
    if "vision_tower" in name and param.dim() >= 2 and "embedding" not in name:
        param.mul_(math.sqrt(64 / 32))


def _qwen_tower_scale(name: str, param: torch.Tensor) -> None:
    """Qwen2-VL's vision matrices at 1/sqrt(fan-in) (the patch embedding's is 3 * 2 * 14 * 14)."""
    if "visual" in name and param.dim() >= 2:
        param.mul_(math.sqrt(64 / param[0].numel()))


def _internvit_scale(name: str, param: torch.Tensor) -> None:
    """InternViT: layer scales around 1 per channel (every layer matters), matrices at 1/sqrt(fan-in)."""
    if "vision_tower" not in name:
        return
    if ".lambda_" in name:
        param.copy_(1.0 + 0.1 * torch.randn(param.shape))
    elif param.dim() >= 2 and "cls_token" not in name and "position_embeddings" not in name:
        param.mul_(math.sqrt(64 / param[0].numel()))


def make_image(seed: int, size: tuple[int, int] = (40, 30)):
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8), "RGB")


def image_data_url(image, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64,{base64.b64encode(buf.getvalue()).decode()}"


# -- Qwen2-VL / Qwen2.5-VL -------------------------------------------------------------------------
QWEN2_VL_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>")
QWEN2_VL_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
QWEN2_VL_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}" + QWEN2_VL_IMAGE +
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ eos_token }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def make_qwen2_vl_checkpoint(tmp_dir, *, version: str = "2", seed: int = 0, tie_word_embeddings: bool = False,
                             min_pixels: int = 4 * 28 * 28, max_pixels: int = 64 * 28 * 28, window_size: int = 56,
                             **text_overrides) -> str:
    """A tiny random-weight Qwen2-VL or Qwen2.5-VL checkpoint (HF format) in ``tmp_dir``, fully offline.

        path = make_qwen2_vl_checkpoint(tmp_path, version="2.5")
        Qwen2_5_VLForConditionalGeneration.from_pretrained(path); qwen2_vl_processor(path)

    ``make_qwen2_vl_checkpoint(tmp_dir, *, version="2" | "2.5", seed=0, tie_word_embeddings=False,
    min_pixels=4 * 28 * 28, max_pixels=64 * 28 * 28, window_size=56, **text_overrides) -> str`` writes:

    - ``config.json`` + ``model.safetensors``: ``Qwen2VLForConditionalGeneration`` or
      ``Qwen2_5_VLForConditionalGeneration`` (transformers' own classes, so the tensor names are the ones
      transformers writes: the Hub's ``model.layers.*``, ``visual.*``, ``lm_head.*``), float32, randomised
      like ``model_factory`` (vision weights at 1/sqrt(fan-in)); the text model has hidden size 64, 2 layers,
      4 heads (head_dim 16), 2 KV heads, vocabulary 512 and M-RoPE with ``mrope_section`` [2, 3, 3]; the
      vision tower is 2 blocks of width 32 on 14-pixel patches (temporal patch 2) merged 2x2 into one
      placeholder token each; Qwen2.5-VL's windows span ``window_size`` pixels (56: 2x2 merged tokens, so an
      image has several) in block 0, block 1 attends over the whole image (``fullatt_block_indexes`` [1]);
    - the tokenizer (``model_factory.make_tokenizer``) with ``<|vision_start|>``, ``<|image_pad|>``,
      ``<|vision_end|>`` and ``<|video_pad|>`` added, whose chat template renders content parts
      ``{"type": "image"}`` as ``<|vision_start|><|image_pad|><|vision_end|>``;
    - the image processor (``preprocessor_config.json``: ``Qwen2VLImageProcessor``, PIL backend) resizing
      images to ``min_pixels`` .. ``max_pixels`` pixels in 28-pixel steps (4 to 64 placeholder tokens an
      image), and ``processor_config.json`` naming ``Qwen2VLProcessor`` / ``Qwen2_5_VLProcessor``, as Hub
      checkpoints ship them: ``AutoImageProcessor.from_pretrained(path)`` loads it, and
      ``qwen2_vl_processor(path)`` the processor (``AutoProcessor.from_pretrained(path)`` needs torchvision,
      for the video processor).
    """
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    if version not in ("2", "2.5"):
        raise ValueError(f"version {version!r} is not one of '2', '2.5'")
    path = os.fspath(tmp_dir)
    os.makedirs(path, exist_ok=True)
    tokenizer = make_tokenizer(VOCAB_SIZE, seed, added_tokens=QWEN2_VL_TOKENS)
    tokenizer.chat_template = QWEN2_VL_CHAT_TEMPLATE
    start_id, image_id, end_id, video_id = tokenizer.convert_tokens_to_ids(list(QWEN2_VL_TOKENS))
    text_config = dict(
        vocab_size=VOCAB_SIZE, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
        pad_token_id=0, rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0},
    )
    text_config.update(text_overrides)
    vision = dict(depth=2, num_heads=2, patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
    if version == "2":
        vision.update(embed_dim=32, hidden_size=64, mlp_ratio=2, hidden_act="quick_gelu")
        config_cls, model_cls, processor_cls = "Qwen2VLConfig", "Qwen2VLForConditionalGeneration", "Qwen2VLProcessor"
    else:
        vision.update(hidden_size=32, intermediate_size=64, out_hidden_size=64, hidden_act="silu",
                      window_size=window_size, fullatt_block_indexes=[1])
        config_cls, model_cls = "Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration"
        processor_cls = "Qwen2_5_VLProcessor"
    config = getattr(transformers, config_cls)(
        text_config=text_config, vision_config=vision, image_token_id=image_id, video_token_id=video_id,
        vision_start_token_id=start_id, vision_end_token_id=end_id, tie_word_embeddings=tie_word_embeddings,
        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    config.architectures = [model_cls]
    config.dtype = "float32"
    _save_random_model(getattr(transformers, model_cls), config, path, seed, _qwen_tower_scale)
    # What a Hub checkpoint ships for its processor. (transformers' processor class itself cannot be built, nor
    # saved, without torchvision, for its video processor: ``qwen2_vl_processor`` below builds it for images.)
    Qwen2VLImageProcessorPil(min_pixels=min_pixels, max_pixels=max_pixels, patch_size=14, temporal_patch_size=2,
                             merge_size=2).save_pretrained(path)
    for name in ("preprocessor_config.json", "processor_config.json"):
        _update_json(os.path.join(path, name), processor_class=processor_cls)
    tokenizer.save_pretrained(path)
    return path


def _update_json(file: str, **values) -> None:
    import json

    data = {}
    if os.path.exists(file):
        with open(file, encoding="utf-8") as f:
            data = json.load(f)
    data.update(values)
    with open(file, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)


def qwen2_vl_processor(path: str):
    """The checkpoint's ``Qwen2VLProcessor`` / ``Qwen2_5_VLProcessor``: ``AutoProcessor.from_pretrained(path)``
    where torchvision is installed; without it (transformers then has no video processor, and refuses to
    build the processor) the same class around ``AutoImageProcessor`` and ``AutoTokenizer``, for images."""
    import json

    import transformers
    from transformers.processing_utils import ProcessorMixin

    try:
        return transformers.AutoProcessor.from_pretrained(path)
    except ImportError:
        pass
    with open(os.path.join(path, "processor_config.json"), encoding="utf-8") as f:
        processor_cls = getattr(transformers, json.load(f)["processor_class"])
    image_processor = transformers.AutoImageProcessor.from_pretrained(path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    original = ProcessorMixin.check_argument_for_proper_class
    ProcessorMixin.check_argument_for_proper_class = lambda self, name, arg: (  # video_processor=None passes
        type(arg) if arg is None else original(self, name, arg))
    try:
        return processor_cls(image_processor=image_processor, tokenizer=tokenizer,
                             chat_template=tokenizer.chat_template)
    finally:
        ProcessorMixin.check_argument_for_proper_class = original


# -- LLaVA-NeXT (llava-v1.6) -----------------------------------------------------------------------
def make_llava_next_checkpoint(tmp_dir, *, image_size: int = 56, patch_size: int = 14,
                               grid_pinpoints: list[list[int]] | None = None, seed: int = 0,
                               vision_feature_layer: int | list[int] = -2, num_layers: int = 2,
                               **text_overrides) -> str:
    """A tiny random-weight LLaVA-NeXT checkpoint (HF format) in ``tmp_dir``, fully offline.

        path = make_llava_next_checkpoint(tmp_path)
        LlavaNextForConditionalGeneration.from_pretrained(path); AutoProcessor.from_pretrained(path)

    Writes what ``make_llava_checkpoint`` does (same tiny decoder, tokenizer, chat template and 2-layer
    CLIP tower on ``image_size``-pixel tiles, strategy "default") for transformers' own
    ``LlavaNextForConditionalGeneration``, plus its learned ``image_newline``; ``grid_pinpoints``
    (default ``[[1, 2], [2, 1], [2, 2]]`` tiles, in pixels (height, width)) lets a wide image get a 1x2
    grid, a tall one 2x1 and a large one 2x2. The tensors carry the Hub's (llava-hf's) names:
    ``language_model.model.*``, ``language_model.lm_head.*``, ``vision_tower.vision_model.*``,
    ``multi_modal_projector.*``, ``image_newline`` (transformers loads them, nothing missing). The image
    processor is ``LlavaNextImageProcessor`` (the PIL backend without torchvision) and the processor
    ``LlavaNextProcessor``, both loadable with ``AutoImageProcessor`` / ``AutoProcessor``.
    """
    import transformers
    from safetensors.torch import load_file, save_file
    from transformers import CLIPVisionConfig, LlavaNextConfig, LlavaNextProcessor
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    path = os.fspath(tmp_dir)
    os.makedirs(path, exist_ok=True)
    if grid_pinpoints is None:
        grid_pinpoints = [[image_size * h, image_size * w] for h, w in ((1, 2), (2, 1), (2, 2))]
    tokenizer = make_tokenizer(VOCAB_SIZE, seed, added_tokens=(IMAGE_TOKEN,))
    tokenizer.chat_template = LLAVA_CHAT_TEMPLATE
    image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    text_config = _hf_config(
        "llama", vocab_size=VOCAB_SIZE, hidden_size=64, num_layers=num_layers, num_heads=4, num_kv_heads=2,
        head_dim=None, intermediate_size=128, max_position_embeddings=512, tie_word_embeddings=False,
        rope_scaling=None, sliding_window=None, overrides=dict(text_overrides),
    )
    vision_config = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=2, image_size=image_size, patch_size=patch_size,
                                     projection_dim=32, hidden_act="quick_gelu", layer_norm_eps=1e-5)
    config = LlavaNextConfig(vision_config=vision_config, text_config=text_config, image_token_index=image_token_id,
                             image_grid_pinpoints=grid_pinpoints, projector_hidden_act="gelu",
                             vision_feature_select_strategy="default", vision_feature_layer=vision_feature_layer,
                             image_seq_length=(image_size // patch_size) ** 2)
    config.architectures = ["LlavaNextForConditionalGeneration"]
    config.dtype = "float32"
    _save_random_model(transformers.LlavaNextForConditionalGeneration, config, path, seed, _clip_tower_scale)
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    hub_names = {}
    for name, tensor in tensors.items():  # transformers writes the tower's tensors without vision_model.
        if name.startswith("vision_tower.") and not name.startswith("vision_tower.vision_model."):
            name = "vision_tower.vision_model." + name.removeprefix("vision_tower.")
        hub_names[name] = tensor
    save_file(hub_names, file, metadata={"format": "pt"})
    image_processor = LlavaNextImageProcessorPil(size={"shortest_edge": image_size},
                                                 crop_size={"height": image_size, "width": image_size},
                                                 image_grid_pinpoints=grid_pinpoints)
    processor = LlavaNextProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=patch_size,
                                   vision_feature_select_strategy="default", chat_template=LLAVA_CHAT_TEMPLATE,
                                   num_additional_image_tokens=1)
    processor.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


# -- InternVL (transformers' native InternVLForConditionalGeneration, InternVL3-*-hf) -----------------
INTERNVL_TOKENS = ("<img>", "</img>", "<IMG_CONTEXT>", "<video>")
INTERNVL_IMAGE_TOKEN = "<IMG_CONTEXT>"
INTERNVL_CHAT_TEMPLATE = LLAVA_CHAT_TEMPLATE.replace("<image>\n", INTERNVL_IMAGE_TOKEN + "\n")


def make_internvl_checkpoint(tmp_dir, *, image_size: int = 56, patch_size: int = 14, min_patches: int = 1,
                             max_patches: int = 4, seed: int = 0, vision_feature_layer: int = -1,
                             norm_type: str = "layer_norm", use_qk_norm: bool = False, use_mean_pooling: bool = True,
                             tie_word_embeddings: bool = False, num_layers: int = 2, **text_overrides) -> str:
    """A tiny random-weight InternVL checkpoint (HF format, InternVL3-*-hf style) in ``tmp_dir``, fully offline.

        path = make_internvl_checkpoint(tmp_path)
        InternVLForConditionalGeneration.from_pretrained(path); internvl_processor(path)

    Writes:

    - ``config.json`` + ``model.safetensors``: transformers' own ``InternVLForConditionalGeneration``, saved with
      the Hub's tensor names (``language_model.model.*``, ``language_model.lm_head.*``, ``vision_tower.*``,
      ``multi_modal_projector.*``; transformers 5 writes those), float32, randomised like ``model_factory``
      (vision weights at 1/sqrt(fan-in), layer scales around 1); the text model is ``model_factory``'s tiny
      Qwen2 (vocabulary 512, ``INTERNVL_TOKENS`` its last added tokens); the vision tower 2 layers of width 32
      (biased q/k/v, ``norm_type``, optional qk-norm, the final LayerNorm read at ``vision_feature_layer`` -1
      unless ``use_mean_pooling``) on ``image_size``-pixel tiles in ``patch_size`` patches, pixel-shuffled 2x2:
      (image_size / patch_size / 2)^2 placeholder tokens a tile (56 / 14: 4); ``tie_word_embeddings`` is the
      top-level config's (what transformers ties by);
    - the tokenizer (``model_factory.make_tokenizer``) with the Hub's ``extra_special_tokens`` (``<img>``,
      ``</img>``, ``<IMG_CONTEXT>``, ``<video>``), whose chat template renders content parts ``{"type": "image"}``
      as ``<IMG_CONTEXT>\\n``;
    - ``preprocessor_config.json`` as the Hub ships it: ``GotOcr2ImageProcessorFast`` (loads as the PIL backend
      without torchvision) with ``crop_to_patches: false`` (``InternVLProcessor`` tiles anyway), ``min_patches`` ..
      ``max_patches`` tiles (1 .. 4: a wide image gets 3x1 tiles + a thumbnail, a small one a single tile), and
      ``processor_config.json`` naming ``InternVLProcessor`` with its ``image_seq_length``. transformers'
      processor class cannot be built, nor saved, without torchvision (its video processor): ``internvl_processor``
      below builds it for images.
    """
    import transformers
    from transformers import InternVLConfig, InternVLVisionConfig
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    path = os.fspath(tmp_dir)
    os.makedirs(path, exist_ok=True)
    tokenizer = make_tokenizer(VOCAB_SIZE, seed, added_tokens=INTERNVL_TOKENS)
    tokenizer.chat_template = INTERNVL_CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    start_image_token, end_image_token, context_image_token, video_token = INTERNVL_TOKENS
    _update_json(os.path.join(path, "tokenizer_config.json"), extra_special_tokens=dict(
        start_image_token=start_image_token, end_image_token=end_image_token,
        context_image_token=context_image_token, video_token=video_token))
    text_config = _hf_config(
        "qwen2", vocab_size=VOCAB_SIZE, hidden_size=64, num_layers=num_layers, num_heads=4, num_kv_heads=2,
        head_dim=None, intermediate_size=128, max_position_embeddings=512, tie_word_embeddings=tie_word_embeddings,
        rope_scaling=None, sliding_window=None, overrides=dict(text_overrides),
    )
    vision_config = InternVLVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=image_size,
        patch_size=patch_size, hidden_act="gelu", layer_norm_eps=1e-6, attention_bias=True, norm_type=norm_type,
        use_qk_norm=use_qk_norm, use_mean_pooling=use_mean_pooling)
    tokens_per_tile = (image_size // patch_size // 2) ** 2
    config = InternVLConfig(
        vision_config=vision_config, text_config=text_config, downsample_ratio=0.5, projector_hidden_act="gelu",
        image_token_id=tokenizer.convert_tokens_to_ids(context_image_token), image_seq_length=tokens_per_tile,
        vision_feature_layer=vision_feature_layer, vision_feature_select_strategy="default",
        tie_word_embeddings=tie_word_embeddings, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    config.architectures = ["InternVLForConditionalGeneration"]
    config.dtype = "float32"
    _save_random_model(transformers.InternVLForConditionalGeneration, config, path, seed, _internvit_scale)
    GotOcr2ImageProcessorPil(size={"height": image_size, "width": image_size}, crop_to_patches=False,
                             min_patches=min_patches, max_patches=max_patches, image_mean=[0.485, 0.456, 0.406],
                             image_std=[0.229, 0.224, 0.225]).save_pretrained(path)
    _update_json(os.path.join(path, "preprocessor_config.json"), image_processor_type="GotOcr2ImageProcessorFast",
                 processor_class="InternVLProcessor")
    _update_json(os.path.join(path, "processor_config.json"), image_seq_length=tokens_per_tile,
                 processor_class="InternVLProcessor")
    return path


def internvl_processor(path: str):
    """The checkpoint's ``InternVLProcessor``: ``AutoProcessor.from_pretrained(path)`` where torchvision is
    installed; without it the same class around ``AutoImageProcessor`` and ``AutoTokenizer`` (with
    processor_config.json's ``image_seq_length``), for images."""
    import importlib.util
    import json

    import transformers
    from transformers.processing_utils import ProcessorMixin

    if importlib.util.find_spec("torchvision") is not None:
        return transformers.AutoProcessor.from_pretrained(path)
    with open(os.path.join(path, "processor_config.json"), encoding="utf-8") as f:
        image_seq_length = json.load(f)["image_seq_length"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    original = ProcessorMixin.check_argument_for_proper_class
    ProcessorMixin.check_argument_for_proper_class = lambda self, name, arg: (  # video_processor=None passes
        type(arg) if arg is None else original(self, name, arg))
    try:
        return transformers.InternVLProcessor(image_processor=transformers.AutoImageProcessor.from_pretrained(path),
                                              tokenizer=tokenizer, image_seq_length=image_seq_length,
                                              chat_template=tokenizer.chat_template)
    finally:
        ProcessorMixin.check_argument_for_proper_class = original
