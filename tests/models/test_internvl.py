"""halserve's InternVL against transformers on a tiny random checkpoint (fp32): the image features of images
with different tile counts (and tower variants: RMSNorm, qk-norm, the final norm, an earlier feature layer),
their token counts and placeholder layout against the processor's, all-token logits of a prompt with two images,
both checkpoint naming schemes, tied embeddings and bad checkpoints and inputs."""
from __future__ import annotations

import shutil

import pytest
import torch
from mm_factory import INTERNVL_IMAGE_TOKEN, internvl_processor, make_image, make_internvl_checkpoint
from paged_harness import PagedHarness
from safetensors.torch import load_file, save_file
from staged import load

from halserve.attention_backends.torch_ref import TorchAttentionBackend
from halserve.models.internvl import InternVLForConditionalGeneration as Model

# (width, height) -> tiles (max 4 + a thumbnail): wide 3x1 + 1, tall 1x4 + 1, large 2x2 + 1, small 1 (no thumbnail)
IMAGE_SIZES = [(200, 60), (50, 180), (150, 140), (40, 30)]
TILES = [4, 5, 5, 1]
PROMPT = f"<|user|>\nCompare {INTERNVL_IMAGE_TOKEN}\nwith {INTERNVL_IMAGE_TOKEN}\nplease.<|assistant|>\n"


def hf_model(path: str):
    from transformers import InternVLForConditionalGeneration

    return InternVLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()


def renamed_checkpoint(src: str, dst, rename) -> str:
    shutil.copytree(src, dst)
    tensors = load_file(f"{dst}/model.safetensors")
    save_file({rename(name): t for name, t in tensors.items()}, f"{dst}/model.safetensors", metadata={"format": "pt"})
    return str(dst)


def images(indices) -> list:
    return [make_image(i, size=IMAGE_SIZES[i]) for i in indices]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return make_internvl_checkpoint(tmp_path_factory.mktemp("internvl"))


@pytest.fixture(scope="module")
def hf(checkpoint):
    return hf_model(checkpoint)


@pytest.fixture(scope="module")
def processor(checkpoint):
    return internvl_processor(checkpoint)


@pytest.fixture(scope="module")
def model(checkpoint):
    return load(checkpoint)


def image_inputs(processor, indices) -> dict[str, torch.Tensor]:
    """What the engine's image processor call gives (tiling as InternVLProcessor does)."""
    return dict(processor.image_processor(images(indices), crop_to_patches=True, return_tensors="pt"))


def image_items(model, processed) -> list[dict[str, torch.Tensor]]:
    return Model.split_image_inputs(model.config, processed, len(processed["num_patches"]))


def check_features(model, hf, processor, indices) -> list[torch.Tensor]:
    processed = image_inputs(processor, indices)
    with torch.no_grad():
        got = model.embed_multimodal(image_items(model, processed))
        want = hf.model.get_image_features(pixel_values=processed["pixel_values"]).pooler_output
    want = want.reshape(-1, want.shape[-1]).split([len(g) for g in got])
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5, msg=lambda m: f"image {i}: {m}")
    return got


def test_embed_multimodal_matches_transformers(model, hf, processor):
    items = image_items(model, image_inputs(processor, range(4)))
    assert [tuple(item["pixel_values"].shape) for item in items] == [(n, 3, 56, 56) for n in TILES]
    calls = []
    tower = model.vision_tower.forward
    model.vision_tower.forward = lambda pixels: calls.append(len(pixels)) or tower(pixels)
    try:
        got = check_features(model, hf, processor, range(4))
    finally:
        del model.vision_tower.forward
    assert calls == [sum(TILES)]  # every tile of every image in one tower call
    assert [len(rows) for rows in got] == [4 * n for n in TILES]  # 4 tokens a tile


@pytest.mark.parametrize("variant", [
    dict(norm_type="rms_norm", use_qk_norm=True, use_mean_pooling=False),  # the final LayerNorm read at -1
    dict(use_mean_pooling=False, vision_feature_layer=-2),  # one layer built, the final norm skipped
])
def test_tower_variants_match_transformers(tmp_path, variant):
    path = make_internvl_checkpoint(tmp_path, **variant)
    model = load(path)
    if variant.get("vision_feature_layer") == -2:
        assert len(model.vision_tower.encoder.layer) == 1 and not hasattr(model.vision_tower, "layernorm")
    check_features(model, hf_model(path), internvl_processor(path), [0, 3])


@pytest.mark.parametrize("index", range(len(IMAGE_SIZES)))
def test_num_image_tokens_and_layout_match_processor(model, processor, index):
    processed = processor(text=f"a {INTERNVL_IMAGE_TOKEN} b", images=images([index]), return_tensors="pt")
    ids = processed["input_ids"][0].tolist()
    context, start, end = processor.image_token_id, processor.start_image_token_id, processor.end_image_token_id
    assert Model.image_token_id(model.config) == context
    item = image_items(model, image_inputs(processor, [index]))[0]
    count = Model.num_image_tokens(model.config, item)
    assert count == ids.count(context) == 4 * TILES[index]
    first = ids.index(context)  # <img>, one contiguous run of the image's placeholders, </img>
    assert ids[first - 1] == start and ids[first : first + count] == [context] * count and ids[first + count] == end
    assert Model.image_token_wrappers(model.config, processor.tokenizer) == ([start], [end])


def embed_prompt(model, input_ids: torch.Tensor, items) -> torch.Tensor:
    """What the model runner feeds: the text embeddings with each image's rows at its placeholders."""
    with torch.no_grad():
        embeds = model.embed_input_ids(input_ids)  # [T, H]
        embeds[input_ids == Model.image_token_id(model.config)] = torch.cat(model.embed_multimodal(items))
    return embeds


def check_prompt_logits(model, hf, processor) -> None:
    """A prompt with two images (tall, small) and a text-only one as one flattened prefill."""
    with_images = processor(text=PROMPT, images=images([1, 3]), return_tensors="pt")
    text_only = processor(text="Tell me a story", return_tensors="pt")
    ids = [with_images.input_ids[0], text_only.input_ids[0]]
    items = image_items(model, image_inputs(processor, [1, 3]))
    embeds = torch.cat([embed_prompt(model, ids[0], items), model.embed_input_ids(ids[1])])
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


def _newer_names(name: str) -> str:  # what InternVLForConditionalGeneration's own state dict names
    for old, new in [("language_model.model.", "model.language_model."), ("language_model.lm_head.", "lm_head."),
                     ("vision_tower.", "model.vision_tower."),
                     ("multi_modal_projector.", "model.multi_modal_projector.")]:
        if name.startswith(old):
            return new + name.removeprefix(old)
    raise AssertionError(name)


def test_checkpoint_naming_schemes_load(checkpoint, hf, processor, tmp_path):
    names = set(load_file(f"{checkpoint}/model.safetensors"))
    assert "language_model.lm_head.weight" in names and "vision_tower.embeddings.cls_token" in names  # the Hub's
    path = renamed_checkpoint(checkpoint, tmp_path / "newer", _newer_names)
    assert set(load_file(f"{path}/model.safetensors")) == set(hf.state_dict())
    check_prompt_logits(load(path), hf, processor)


def test_tied_embeddings_match_transformers(tmp_path):
    path = make_internvl_checkpoint(tmp_path, tie_word_embeddings=True, seed=1)
    assert "language_model.lm_head.weight" not in load_file(f"{path}/model.safetensors")
    model = load(path)
    assert model.language_model.tie_word_embeddings
    check_prompt_logits(model, hf_model(path), internvl_processor(path))


@pytest.mark.parametrize("extra", ["vision_tower.encoder.layer.0.lambda_3", "model.vision_tower.head.weight",
                                   "model.multi_modal_projector.linear_3.weight", "image_newline"])
def test_unknown_tensor_is_a_clear_error(checkpoint, tmp_path, extra):
    path = renamed_checkpoint(checkpoint, tmp_path / "bad", lambda n: n)
    tensors = load_file(f"{path}/model.safetensors")
    tensors[extra] = torch.zeros(4, 4)
    save_file(tensors, f"{path}/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"{extra.replace('.', '[.]')}.*no matching parameter"):
        load(path)


def test_bad_shape_is_a_clear_error(checkpoint, tmp_path):
    path = renamed_checkpoint(checkpoint, tmp_path / "bad", lambda n: n)
    tensors = load_file(f"{path}/model.safetensors")
    tensors["multi_modal_projector.layer_norm.weight"] = torch.zeros(7)
    save_file(tensors, f"{path}/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"projector[.]layer_norm[.]weight.*shape \(7,\), expected \(128,\)"):
        load(path)


def test_bad_inputs_and_configs_are_clear_errors(model, processor):
    with pytest.raises(ValueError, match="pixel_values and num_patches"):
        Model.split_image_inputs(model.config, {"pixel_values": torch.zeros(2, 3, 56, 56)}, 1)
    with pytest.raises(ValueError, match=r"expected \(3, 3, S, S\)"):
        Model.split_image_inputs(model.config, {"pixel_values": torch.zeros(2, 3, 56, 56),
                                                "num_patches": torch.tensor([3])}, 1)
    with pytest.raises(ValueError, match=r"pixel_values \[tiles, 3, S, S\]"):
        Model.num_image_tokens(model.config, {"pixel_values": torch.zeros(3, 56, 56)})
    with pytest.raises(ValueError, match="56x56 tiles"):
        model.embed_multimodal([{"pixel_values": torch.zeros(1, 3, 28, 28)}])
    with pytest.raises(ValueError, match=r"no '</img>' token"):
        Model.image_token_wrappers(model.config, type("Tok", (), {"convert_tokens_to_ids": lambda self, t: (
            None if t == "</img>" else 5)})())
    config = model.config.__class__.from_dict(model.config.to_dict())
    config.vision_feature_select_strategy = "full"
    with pytest.raises(ValueError, match="'full' is not supported"):
        Model(config, None)
    config = model.config.__class__.from_dict(model.config.to_dict())
    config.text_config.model_type = "gemma"
    with pytest.raises(ValueError, match="'gemma' language model is not supported"):
        Model(config, None)
