"""halserve's LLaVA against transformers on tiny random checkpoints (fp32): the image features,
all-token logits of a prompt with an image spliced in (then greedy decoding through the paged
cache), both checkpoint naming schemes, feature-layer/strategy variants and bad checkpoints."""
from __future__ import annotations

import copy
import shutil

import pytest
import torch
from mm_factory import IMAGE_TOKEN, make_image, make_llava_checkpoint
from paged_harness import PagedHarness
from safetensors.torch import load_file, save_file
from staged import load

from halserve.attention_backends.torch_ref import TorchAttentionBackend
from halserve.layers import ModelContext
from halserve.models.llava import LlavaForConditionalGeneration

ATOL = 1e-4
PROMPTS = [f"<|user|>\n{IMAGE_TOKEN}\nWhat is in this picture?", "Tell me a story"]


def hf_model(path: str):
    from transformers import LlavaForConditionalGeneration as HFLlava

    return HFLlava.from_pretrained(path, dtype=torch.float32).eval()


def processor(path: str):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(path)


def pixel_values(path: str, seeds) -> torch.Tensor:
    return processor(path).image_processor([make_image(s) for s in seeds], return_tensors="pt").pixel_values


def hf_image_features(hf, pixels: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.stack(list(hf.get_image_features(pixel_values=pixels).pooler_output))  # [N, tokens, H]


def embed_prompt(model, input_ids: torch.Tensor, pixels: torch.Tensor | None) -> torch.Tensor:
    """What the model runner feeds: the text embeddings with each image's rows at its placeholders."""
    with torch.no_grad():
        embeds = model.embed_input_ids(input_ids)  # [T, H]
        if pixels is not None:
            is_image = input_ids == LlavaForConditionalGeneration.image_token_id(model.config)
            embeds[is_image] = model.embed_images(pixels).reshape(-1, embeds.shape[-1])
    return embeds


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return make_llava_checkpoint(tmp_path_factory.mktemp("llava"))


@pytest.fixture(scope="module")
def hf(checkpoint):
    return hf_model(checkpoint)


@pytest.fixture(scope="module")
def model(checkpoint):
    return load(checkpoint)


def test_embed_images_matches_transformers(checkpoint, model, hf):
    pixels = pixel_values(checkpoint, [0, 1])
    with torch.no_grad():
        got = model.embed_images(pixels)
    assert got.shape == (2, LlavaForConditionalGeneration.num_image_tokens(model.config), 64) == (2, 16, 64)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, hf_image_features(hf, pixels), atol=1e-5, rtol=1e-5)
    assert LlavaForConditionalGeneration.image_token_id(model.config) == model.config.image_token_index
    assert len(model.vision_tower.encoder.layers) == 1  # feature layer -2 of 2: the last one is not built


def check_prompt_logits(model, hf, path: str, decode_steps: int = 3) -> None:
    """A prompt with an image and a text-only one as one flattened prefill, then batched decodes."""
    proc = processor(path)
    with_image = proc(text=PROMPTS[0], images=make_image(0), return_tensors="pt")
    text_only = proc(text=PROMPTS[1], return_tensors="pt")
    ids = [with_image.input_ids[0], text_only.input_ids[0]]
    image_token_id = LlavaForConditionalGeneration.image_token_id(model.config)
    assert int((ids[0] == image_token_id).sum()) == 16
    embeds = torch.cat([embed_prompt(model, ids[0], with_image.pixel_values), embed_prompt(model, ids[1], None)])
    harness = PagedHarness(model, TorchAttentionBackend)
    logits = harness.step([(f"r{i}", p.tolist()) for i, p in enumerate(ids)], inputs_embeds=embeds)
    with torch.no_grad():
        wants = [hf(**with_image).logits[0], hf(**text_only).logits[0]]
    offset, generated = 0, []
    for i, (prompt, want) in enumerate(zip(ids, wants)):
        got = logits[offset : offset + len(prompt)]
        torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-4, msg=lambda m: f"prompt {i}: {m}")
        generated.append([int(got[-1].argmax())])
        offset += len(prompt)
    for _ in range(decode_steps - 1):
        logits = harness.step([(f"r{i}", [g[-1]]) for i, g in enumerate(generated)])
        for i, g in enumerate(generated):
            g.append(int(logits[i].argmax()))
    with torch.no_grad():
        out = hf.generate(**with_image, max_new_tokens=decode_steps, do_sample=False, pad_token_id=0)
    assert generated[0] == out[0, len(ids[0]):].tolist()


def test_prompt_with_image_matches_transformers(checkpoint, model, hf):
    check_prompt_logits(model, hf, checkpoint)


def test_pipeline_stages_match_transformers(checkpoint, hf):
    from halserve.models.pipeline import PPMissingLayer

    staged = load(checkpoint, num_stages=2)
    first, last = staged.stages
    assert not isinstance(first.vision_tower, PPMissingLayer)
    assert isinstance(last.vision_tower, PPMissingLayer) and isinstance(last.multi_modal_projector, PPMissingLayer)
    assert not any(name.startswith(("vision_tower.", "multi_modal_projector.")) for name, _ in last.named_parameters())
    check_prompt_logits(staged, hf, checkpoint)


def renamed_checkpoint(src: str, dst, rename) -> str:
    shutil.copytree(src, dst)
    tensors = load_file(f"{dst}/model.safetensors")
    save_file({rename(name): t for name, t in tensors.items()}, f"{dst}/model.safetensors", metadata={"format": "pt"})
    return str(dst)


def _newer_names(name: str) -> str:  # model.language_model.*, lm_head.*, model.vision_tower.* ...
    for old, new in [("language_model.model.", "model.language_model."), ("language_model.lm_head.", "lm_head."),
                     ("vision_tower.", "model.vision_tower."),
                     ("multi_modal_projector.", "model.multi_modal_projector.")]:
        if name.startswith(old):
            return new + name.removeprefix(old)
    raise AssertionError(name)


def _hub_names(name: str) -> str:  # llava-hf on the Hub: the tower under vision_tower.vision_model.*
    return name.replace("vision_tower.", "vision_tower.vision_model.", 1)


@pytest.mark.parametrize("rename", [_newer_names, _hub_names], ids=["newer", "hub"])
def test_checkpoint_naming_schemes_load(checkpoint, hf, tmp_path, rename):
    path = renamed_checkpoint(checkpoint, tmp_path / "renamed", rename)
    assert any(n != rename(n) for n in load_file(f"{checkpoint}/model.safetensors"))
    check_prompt_logits(load(path), hf, checkpoint, decode_steps=1)


@pytest.mark.parametrize("strategy, layer, num_tokens", [("full", -2, 17), ("default", [-2, -1], 16),
                                                         ("full", [0, -1], 17)])
def test_feature_variants_match_transformers(tmp_path, strategy, layer, num_tokens):
    path = make_llava_checkpoint(tmp_path, vision_feature_select_strategy=strategy, vision_feature_layer=layer)
    model = load(path)
    assert LlavaForConditionalGeneration.num_image_tokens(model.config) == num_tokens
    pixels = pixel_values(path, [2, 3])
    with torch.no_grad():
        got = model.embed_images(pixels)
    assert got.shape == (2, num_tokens, 64)
    torch.testing.assert_close(got, hf_image_features(hf_model(path), pixels), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("extra", ["vision_head.weight", "vision_tower.encoder.layers.0.mlp.fc3.weight",
                                   "model.vision_tower.vision_model.encoder.layers.0.mlp.fc3.weight",
                                   "model.multi_modal_projector.linear_3.weight"])
def test_unknown_tensor_is_a_clear_error(checkpoint, tmp_path, extra):
    path = renamed_checkpoint(checkpoint, tmp_path / "bad", lambda n: n)
    tensors = load_file(f"{path}/model.safetensors")
    tensors[extra] = torch.zeros(4, 4)
    save_file(tensors, f"{path}/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"{extra.replace('.', '[.]')}.*no matching parameter"):
        load(path)


def test_unsupported_text_model_is_a_clear_error(model):
    hf_config = copy.deepcopy(model.config)
    hf_config.text_config.model_type = "gemma"
    ctx = ModelContext(platform_name="cpu", dtype=torch.float32, attn_backend_cls=TorchAttentionBackend)
    with pytest.raises(ValueError, match="'gemma' language model"):
        LlavaForConditionalGeneration(hf_config, ctx)
