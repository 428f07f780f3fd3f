"""halserve's Qwen2-VL and Qwen2.5-VL against transformers on tiny random checkpoints (fp32), both
versions: the image features of two images of different sizes (Qwen2.5-VL: windowed), placeholder counts
against the processor, M-RoPE positions against ``get_rope_index``, all-token logits of a prompt with two
images (then greedy decoding through the paged cache at index + delta), pipeline stages, both checkpoint
naming schemes, tied embeddings (the Qwen2-VL checkpoint) and bad checkpoints."""
from __future__ import annotations

import shutil
from types import SimpleNamespace

import pytest
import torch
from mm_factory import QWEN2_VL_IMAGE, make_image, make_qwen2_vl_checkpoint, qwen2_vl_processor
from paged_harness import PagedHarness
from safetensors.torch import load_file, save_file
from staged import StagedModel, load

from halserve.attention_backends.torch_ref import TorchAttentionBackend
from halserve.layers import ModelContext
from halserve.layers.rotary import MRotaryEmbedding, get_rope
from halserve.models.pipeline import PPMissingLayer
from halserve.models.qwen2_vl import Qwen2_5_VLForConditionalGeneration, Qwen2VLForConditionalGeneration
from halserve.models.qwen2_vl_vision import window_order

ATOL = 1e-4
PROMPT = f"<|user|>\n{QWEN2_VL_IMAGE}What is in this picture?{QWEN2_VL_IMAGE} And here"
TEXT_PROMPT = "Tell me a story"
IMAGE_SIZES = [(40, 30), (100, 60)]  # -> 4x6 and 4x8 patches: 6 and 8 placeholder tokens
OURS = {"2": Qwen2VLForConditionalGeneration, "2.5": Qwen2_5_VLForConditionalGeneration}


def images():
    return [make_image(i, size) for i, size in enumerate(IMAGE_SIZES)]


def image_items(path: str, cls) -> list[dict[str, torch.Tensor]]:
    """What the engine feeds the model: the image processor's batched output, split per image."""
    from transformers import AutoConfig, AutoImageProcessor

    processed = AutoImageProcessor.from_pretrained(path)(images=images(), return_tensors="pt")
    return cls.split_image_inputs(AutoConfig.from_pretrained(path), processed, len(IMAGE_SIZES))


def model_class(model) -> type:
    return type(model.stages[0] if isinstance(model, StagedModel) else model)


def embed_prompt(model, input_ids: torch.Tensor, items) -> torch.Tensor:
    """What the model runner feeds: the text embeddings with each image's rows at its placeholders."""
    with torch.no_grad():
        embeds = model.embed_input_ids(input_ids)  # [T, H]
        if items:
            is_image = input_ids == model_class(model).image_token_id(model.config)
            embeds[is_image] = torch.cat(model.embed_multimodal(items))
    return embeds


@pytest.fixture(scope="module", params=["2", "2.5"], ids=["qwen2_vl", "qwen2_5_vl"])
def version(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def checkpoint(version, tmp_path_factory) -> str:  # Qwen2-VL's ties its embeddings (as Qwen2-VL-2B does)
    return make_qwen2_vl_checkpoint(tmp_path_factory.mktemp(f"qwen{version}"), version=version,
                                    tie_word_embeddings=version == "2")


@pytest.fixture(scope="module")
def hf(checkpoint, version):
    import transformers

    name = {"2": "Qwen2VLForConditionalGeneration", "2.5": "Qwen2_5_VLForConditionalGeneration"}[version]
    return getattr(transformers, name).from_pretrained(checkpoint, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def model(checkpoint):
    return load(checkpoint)


def test_embed_multimodal_matches_transformers(checkpoint, model, hf, version):
    cls = OURS[version]
    assert type(model) is cls
    items = image_items(checkpoint, cls)
    with torch.no_grad():
        got = model.embed_multimodal(items)
        want = hf.model.get_image_features(pixel_values=torch.cat([i["pixel_values"] for i in items]),
                                           image_grid_thw=torch.stack([i["image_grid_thw"] for i in items]))
        alone = model.embed_multimodal(items[1:])[0]  # attention never crosses images
    assert [tuple(g.shape) for g in got] == [(6, 64), (8, 64)]
    for g, w in zip(got, want.pooler_output):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(alone, got[1], atol=1e-6, rtol=1e-6)
    if version == "2.5":  # the windows are exercised: several an image, and they matter
        grids = [i["image_grid_thw"].tolist() for i in items]
        assert [sum(n > 0 for n in window_order([g], 2, 56, 14)[1]) for g in grids] == [2, 2]
        model.visual.fullatt_block_indexes = {0, 1}
        try:
            with torch.no_grad():
                unwindowed = model.embed_multimodal(items)
        finally:
            model.visual.fullatt_block_indexes = {1}
        assert (unwindowed[0] - got[0]).abs().max() > 1e-3


def test_placeholders_match_the_processor(checkpoint, model, version):
    cls = OURS[version]
    items = image_items(checkpoint, cls)
    inputs = qwen2_vl_processor(checkpoint)(text=PROMPT, images=images(), return_tensors="pt")
    ids = inputs.input_ids[0].tolist()
    image_token = cls.image_token_id(model.config)
    runs = [len(run) for run in "".join("x" if t == image_token else " " for t in ids).split()]
    assert runs == [cls.num_image_tokens(model.config, item) for item in items] == [6, 8]
    assert torch.equal(torch.cat([i["pixel_values"] for i in items]), inputs.pixel_values)
    assert [i["image_grid_thw"].tolist() for i in items] == inputs.image_grid_thw.tolist() == [[1, 4, 6], [1, 4, 8]]
    with pytest.raises(ValueError, match=r"expected \(3, 3\)"):
        cls.split_image_inputs(model.config, {"pixel_values": inputs.pixel_values,
                                              "image_grid_thw": inputs.image_grid_thw}, 3)


def test_mrope_positions_match_transformers(checkpoint, model, hf, version):
    cls = OURS[version]
    items = image_items(checkpoint, cls)
    proc = qwen2_vl_processor(checkpoint)
    for prompt, prompt_images in [(PROMPT, images()), (f"{QWEN2_VL_IMAGE}{TEXT_PROMPT}{QWEN2_VL_IMAGE}", images()),
                                  (TEXT_PROMPT, None)]:
        inputs = proc(text=prompt, images=prompt_images, return_tensors="pt")
        want, want_delta = hf.model.get_rope_index(inputs.input_ids, mm_token_type_ids=inputs.mm_token_type_ids,
                                                   image_grid_thw=inputs.get("image_grid_thw"))
        got, delta = cls.mrope_positions(model.config, inputs.input_ids[0].tolist(), items if prompt_images else [])
        assert got.dtype == torch.int64 and torch.equal(got, want[:, 0]), prompt
        assert delta == int(want_delta) and (delta < 0) == (prompt_images is not None)
    ids = proc(text=PROMPT, images=images(), return_tensors="pt").input_ids[0].tolist()
    with pytest.raises(ValueError, match="placeholders for 2 of its 3 images"):
        cls.mrope_positions(model.config, ids, items + items[:1])
    with pytest.raises(ValueError, match="more image placeholder runs"):
        cls.mrope_positions(model.config, ids, items[:1])
    with pytest.raises(ValueError, match="needs 8 placeholder tokens"):
        cls.mrope_positions(model.config, ids, items[::-1])


def check_prompt_logits(model, hf, path: str, decode_steps: int = 3) -> None:
    """The prompt with two images and a text-only one as one flattened prefill at M-RoPE positions
    [3, T], then batched decodes at index + delta ([T] positions)."""
    cls = model_class(model)
    proc = qwen2_vl_processor(path)
    with_images = proc(text=PROMPT, images=images(), return_tensors="pt")
    text_only = proc(text=TEXT_PROMPT, return_tensors="pt")
    ids = [with_images.input_ids[0], text_only.input_ids[0]]
    items = image_items(path, cls)
    (positions, delta), (text_positions, text_delta) = (cls.mrope_positions(model.config, p.tolist(), i)
                                                        for p, i in zip(ids, [items, []]))
    embeds = torch.cat([embed_prompt(model, ids[0], items), embed_prompt(model, ids[1], [])])
    harness = PagedHarness(model, TorchAttentionBackend)
    logits = harness.step([(f"r{i}", p.tolist()) for i, p in enumerate(ids)], inputs_embeds=embeds,
                          positions=torch.cat([positions, text_positions], dim=1))
    with torch.no_grad():
        wants = [hf(**with_images).logits[0], hf(**text_only).logits[0]]
    offset, generated = 0, []
    for i, (prompt, want) in enumerate(zip(ids, wants)):
        got = logits[offset : offset + len(prompt)]
        torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-4, msg=lambda m: f"prompt {i}: {m}")
        generated.append([int(got[-1].argmax())])
        offset += len(prompt)
    for step in range(decode_steps - 1):
        decode_positions = torch.tensor([len(p) + step + d for p, d in zip(ids, [delta, text_delta])])
        logits = harness.step([(f"r{i}", [g[-1]]) for i, g in enumerate(generated)], positions=decode_positions)
        for i, g in enumerate(generated):
            g.append(int(logits[i].argmax()))
    with torch.no_grad():
        out = hf.generate(**with_images, max_new_tokens=decode_steps, do_sample=False, pad_token_id=0)
    assert generated[0] == out[0, len(ids[0]):].tolist()


def test_prompt_with_images_matches_transformers(checkpoint, model, hf):
    check_prompt_logits(model, hf, checkpoint, decode_steps=4)


def test_pipeline_stages_match_transformers(checkpoint, hf):
    staged = load(checkpoint, num_stages=2)
    first, last = staged.stages
    assert not isinstance(first.visual, PPMissingLayer) and isinstance(last.visual, PPMissingLayer)
    assert not any(name.startswith("visual.") for name, _ in last.named_parameters())
    check_prompt_logits(staged, hf, checkpoint, decode_steps=2)


def renamed_checkpoint(src: str, dst, rename) -> str:
    shutil.copytree(src, dst)
    tensors = load_file(f"{dst}/model.safetensors")
    save_file({rename(name): t for name, t in tensors.items()}, f"{dst}/model.safetensors", metadata={"format": "pt"})
    return str(dst)


def _newer_names(name: str) -> str:  # model.language_model.*, model.visual.*, lm_head.*
    if name.startswith("visual."):
        return "model." + name
    return name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name


def test_checkpoint_naming_schemes_load(checkpoint, model, version, tmp_path):
    saved = set(load_file(f"{checkpoint}/model.safetensors"))  # what transformers writes: the Hub's names
    assert any(n.startswith("visual.") for n in saved) and any(n.startswith("model.layers.") for n in saved)
    assert ("lm_head.weight" in saved) == (version == "2.5")  # Qwen2-VL's is tied: not saved
    newer = load(renamed_checkpoint(checkpoint, tmp_path / "newer", _newer_names))
    want = model.state_dict()
    got = newer.state_dict()
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
    lm_head = model.language_model.lm_head.weight
    assert (lm_head.data_ptr() == model.language_model.model.embed_tokens.weight.data_ptr()) == (version == "2")


@pytest.mark.parametrize("extra", ["vision_head.weight", "visual.blocks.0.mlp.fc3.weight",
                                   "model.visual.merger.mlp.4.weight", "model.layers.0.mlp.fc3.weight"])
def test_unknown_tensor_is_a_clear_error(checkpoint, tmp_path, extra):
    path = renamed_checkpoint(checkpoint, tmp_path / "bad", lambda n: n)
    tensors = load_file(f"{path}/model.safetensors")
    tensors[extra] = torch.zeros(4, 4)
    save_file(tensors, f"{path}/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"{extra.replace('.', '[.]')}.*no matching parameter"):
        load(path)


def test_wrong_vision_version_is_a_clear_error(model, version):
    other = OURS["2.5" if version == "2" else "2"]
    ctx = ModelContext(platform_name="cpu", dtype=torch.float32, attn_backend_cls=TorchAttentionBackend)
    with pytest.raises(ValueError, match="vision_config"):
        other(model.config, ctx)


def test_mrotary_matches_transformers():
    """M-RoPE on its own (the decoder's, the same in both versions): [3, T] positions with distinct axes,
    and [T] as all three axes equal."""
    from transformers import Qwen2VLConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRotaryEmbedding, apply_rotary_pos_emb
    text = Qwen2VLConfig(text_config=dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                          max_position_embeddings=64, rope_parameters={
                                              "rope_type": "default", "mrope_section": [2, 2, 4],
                                              "rope_theta": 10000.0})).text_config
    ctx = ModelContext(platform_name="cpu", dtype=torch.float32, attn_backend_cls=TorchAttentionBackend)
    rope = get_rope(text, 16, ctx)
    assert isinstance(rope, MRotaryEmbedding) and rope.mrope_section == [2, 2, 4]
    gen = torch.Generator().manual_seed(0)
    positions = torch.randint(0, 64, (3, 10), generator=gen)
    q, k = torch.randn(10, 4 * 16, generator=gen), torch.randn(10, 2 * 16, generator=gen)
    cos, sin = Qwen2VLRotaryEmbedding(text)(q, positions[:, None, :])  # [1, T, 16] each
    want_q, want_k = apply_rotary_pos_emb(q.view(1, 10, 4, 16).transpose(1, 2), k.view(1, 10, 2, 16).transpose(1, 2),
                                          cos, sin)
    got_q, got_k = rope(positions, q, k)
    torch.testing.assert_close(got_q, want_q.transpose(1, 2).reshape(10, -1), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got_k, want_k.transpose(1, 2).reshape(10, -1), atol=1e-6, rtol=1e-6)
    flat = positions[0]
    for got, want in zip(rope(flat, q, k), rope(flat.expand(3, -1), q, k)):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    older = SimpleNamespace(max_position_embeddings=64, rope_parameters={"type": "mrope", "mrope_section": [2, 2, 4]})
    assert isinstance(get_rope(older, 16, ctx), MRotaryEmbedding)  # transformers 4's spelling
    with pytest.raises(ValueError, match="needs rope_parameters\\['mrope_section'\\]"):
        get_rope(SimpleNamespace(max_position_embeddings=64, rope_parameters={"type": "mrope"}), 16, ctx)
    with pytest.raises(ValueError, match="summing to rotary_dim / 2 = 8"):
        get_rope(SimpleNamespace(max_position_embeddings=64, rope_parameters={"mrope_section": [2, 2, 2]}), 16, ctx)
