"""halserve's LLaVA-NeXT against transformers on a tiny random checkpoint (fp32): the packed image
features of images of different aspect ratios (so different grids and unpadding), their token counts
against the processor's, all-token logits of a prompt with two images, both checkpoint naming schemes
and bad checkpoints."""
from __future__ import annotations

import shutil

import pytest
import torch
from mm_factory import IMAGE_TOKEN, make_image, make_llava_next_checkpoint
from paged_harness import PagedHarness
from safetensors.torch import load_file, save_file
from staged import load

from halserve.attention_backends.torch_ref import TorchAttentionBackend
from halserve.models.llava_next import LlavaNextForConditionalGeneration as Model

# (width, height): wide -> a 1x2 grid, tall -> 2x1, large -> 2x2; small -> 1x2 upscaled, padded left and right
IMAGE_SIZES = [(200, 60), (50, 180), (150, 140), (40, 30)]
PROMPT = f"<|user|>\nCompare {IMAGE_TOKEN}\nwith {IMAGE_TOKEN}\nplease.<|assistant|>\n"


def renamed_checkpoint(src: str, dst, rename) -> str:
    shutil.copytree(src, dst)
    tensors = load_file(f"{dst}/model.safetensors")
    save_file({rename(name): t for name, t in tensors.items()}, f"{dst}/model.safetensors", metadata={"format": "pt"})
    return str(dst)


def images(indices) -> list:
    return [make_image(i, size=IMAGE_SIZES[i]) for i in indices]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return make_llava_next_checkpoint(tmp_path_factory.mktemp("llava_next"))


@pytest.fixture(scope="module")
def hf(checkpoint):
    from transformers import LlavaNextForConditionalGeneration

    return LlavaNextForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def processor(checkpoint):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(checkpoint)


@pytest.fixture(scope="module")
def model(checkpoint):
    return load(checkpoint)


def image_items(model, processed) -> list[dict[str, torch.Tensor]]:
    inputs = {"pixel_values": processed["pixel_values"], "image_sizes": processed["image_sizes"]}
    return Model.split_image_inputs(model.config, inputs, len(inputs["image_sizes"]))


def test_embed_multimodal_matches_transformers(model, hf, processor):
    processed = processor.image_processor(images(range(4)), return_tensors="pt")
    items = image_items(model, processed)
    assert [tuple(item["pixel_values"].shape) for item in items] == [(3, 3, 56, 56), (3, 3, 56, 56),
                                                                     (5, 3, 56, 56), (3, 3, 56, 56)]
    assert [item["image_sizes"].tolist() for item in items] == [[h, w] for w, h in IMAGE_SIZES]
    calls = []
    tower = model.vision_tower.hidden_states
    model.vision_tower.hidden_states = lambda pixels, layers: calls.append(len(pixels)) or tower(pixels, layers)
    try:
        with torch.no_grad():
            got = model.embed_multimodal(items)
    finally:
        del model.vision_tower.hidden_states
    assert calls == [14]  # every tile of every image in one tower call
    with torch.no_grad():
        want = hf.model.get_image_features(pixel_values=processed["pixel_values"],
                                           image_sizes=processed["image_sizes"]).pooler_output
    assert len(got) == len(want) == 4
    assert len({rows.shape[0] for rows in got}) == 4  # each image its own count
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5, msg=lambda m: f"image {i}: {m}")


def test_feature_layers_variant_matches_transformers(tmp_path):
    from transformers import AutoProcessor, LlavaNextForConditionalGeneration

    path = make_llava_next_checkpoint(tmp_path, vision_feature_layer=[0, -1])
    model, hf = load(path), LlavaNextForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    processed = AutoProcessor.from_pretrained(path).image_processor(images([0, 2]), return_tensors="pt")
    with torch.no_grad():
        got = model.embed_multimodal(image_items(model, processed))
        want = hf.model.get_image_features(**processed).pooler_output
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("index", range(len(IMAGE_SIZES)))
def test_num_image_tokens_matches_processor(model, processor, index):
    processed = processor(text=f"a {IMAGE_TOKEN} b", images=images([index]), return_tensors="pt")
    item = image_items(model, processed)[0]
    want = int((processed["input_ids"] == processor.image_token_id).sum())
    assert Model.num_image_tokens(model.config, item) == want


def embed_prompt(model, input_ids: torch.Tensor, items) -> torch.Tensor:
    """What the model runner feeds: the text embeddings with each image's rows at its placeholders."""
    with torch.no_grad():
        embeds = model.embed_input_ids(input_ids)  # [T, H]
        is_image = input_ids == Model.image_token_id(model.config)
        embeds[is_image] = torch.cat(model.embed_multimodal(items))
    return embeds


def check_prompt_logits(model, hf, processor) -> None:
    """A prompt with two images (tall, large) and a text-only one as one flattened prefill."""
    with_images = processor(text=PROMPT, images=images([1, 2]), return_tensors="pt")
    text_only = processor(text="Tell me a story", return_tensors="pt")
    ids = [with_images.input_ids[0], text_only.input_ids[0]]
    embeds = torch.cat([embed_prompt(model, ids[0], image_items(model, with_images)),
                        model.embed_input_ids(ids[1])])
    harness = PagedHarness(model, TorchAttentionBackend)
    logits = harness.step([(f"r{i}", p.tolist()) for i, p in enumerate(ids)], inputs_embeds=embeds)
    with torch.no_grad():
        wants = [hf(**with_images).logits[0], hf(**text_only).logits[0]]
    offset = 0
    for i, (prompt, want) in enumerate(zip(ids, wants)):
        got = logits[offset : offset + len(prompt)]
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=lambda m: f"prompt {i}: {m}")
        offset += len(prompt)


def test_prompt_with_two_images_matches_transformers(model, hf, processor):
    check_prompt_logits(model, hf, processor)


def _newer_names(name: str) -> str:  # what LlavaNextForConditionalGeneration's own state dict names
    for old, new in [("language_model.model.", "model.language_model."), ("language_model.lm_head.", "lm_head."),
                     ("vision_tower.vision_model.", "model.vision_tower."),
                     ("multi_modal_projector.", "model.multi_modal_projector."),
                     ("image_newline", "model.image_newline")]:
        if name.startswith(old):
            return new + name.removeprefix(old)
    raise AssertionError(name)


def test_checkpoint_naming_schemes_load(checkpoint, hf, processor, tmp_path):
    names = set(load_file(f"{checkpoint}/model.safetensors"))
    assert "image_newline" in names and any(n.startswith("vision_tower.vision_model.") for n in names)  # the Hub's
    path = renamed_checkpoint(checkpoint, tmp_path / "newer", _newer_names)
    assert {_newer_names(n) for n in names} == set(load_file(f"{path}/model.safetensors"))
    assert set(load_file(f"{path}/model.safetensors")) >= {k for k in hf.state_dict() if "newline" in k}
    check_prompt_logits(load(path), hf, processor)


@pytest.mark.parametrize("extra", ["image_newline_2", "model.image_newline.bias", "vision_tower.vision_model.head.w",
                                   "model.multi_modal_projector.linear_3.weight"])
def test_unknown_tensor_is_a_clear_error(checkpoint, tmp_path, extra):
    path = renamed_checkpoint(checkpoint, tmp_path / "bad", lambda n: n)
    tensors = load_file(f"{path}/model.safetensors")
    tensors[extra] = torch.zeros(4, 4)
    save_file(tensors, f"{path}/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"{extra.replace('.', '[.]')}.*no matching parameter"):
        load(path)


def test_bad_inputs_are_clear_errors(model):
    item = {"pixel_values": torch.zeros(2, 3, 56, 56), "image_sizes": torch.tensor([60, 200])}
    with pytest.raises(ValueError, match="has 2 tiles, expected 3"):
        model.embed_multimodal([item])
    with pytest.raises(ValueError, match="image_sizes"):
        Model.num_image_tokens(model.config, {"pixel_values": item["pixel_values"]})
    with pytest.raises(ValueError, match="pixel_values and image_sizes"):
        Model.split_image_inputs(model.config, {"pixel_values": torch.zeros(1, 3, 3, 56, 56)}, 1)
