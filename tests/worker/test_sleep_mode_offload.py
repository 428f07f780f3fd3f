"""Sleep level 1 on a device platform's path frees every weight (issue 30, review of the CUDA path),
checked on the CPU through the same code: ``Platform.offload_weights`` / ``restore_weights`` (the
defaults a device platform inherits, swapped in for the CPU's no-ops) driven by ``LLM.sleep(1)`` /
``wake_up`` and ``update_weights``.

Device-agnostic checks: every tensor the model reaches (parameters, buffers, tensors kept as module
attributes, alone or inside lists, tuples, dicts and dataclasses, found by this file's own walk) no
longer shares storage with what it held before ``sleep(1)``; after ``wake_up`` the host copies are
freed (storage weakrefs), tensors that shared a storage still share one (fp8_block's ``block_scale``
and its scale: not held twice), and greedy outputs are unchanged. Model kinds: compressed-tensors
W4A16 (repacked qweight/qzeros/scales), W8A8 (``w_scale``), FP8_BLOCK (``block_scale``) and a
DeepSeek-V2-Lite-shaped MLA model (``w_uk`` / ``w_uv``). ``update_weights`` asleep at level 1 leaves
the new weights in host memory (where ``offload_weights`` put them) and frees the old host copies.
``move_weights`` itself on a hand-built module: tied weights, a view of a parameter, a frozen
dataclass, a list of tuples, the KV cache left alone.
"""
from __future__ import annotations

import dataclasses
import gc
from collections.abc import Iterator

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from halserve import LLM, SamplingParams
from halserve.platforms.base import Platform
from halserve.platforms.cpu import CpuPlatform

PROMPTS = [{"prompt_token_ids": [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]},
           {"prompt_token_ids": [11, 12, 13]}]
ENGINE_KWARGS = dict(platform="cpu", dtype="float32", max_model_len=128, block_size=16, num_kv_blocks=32,
                     max_num_seqs=2, max_num_batched_tokens=64, enable_sleep_mode=True)
# the attribute each kind keeps outside its parameters (the review's list): must be found on some module
KIND_ATTRIBUTES = {"W4A16": "scales", "W8A8": "w_scale", "FP8_BLOCK": "block_scale", "mla": "w_uk"}


@dataclasses.dataclass(frozen=True, slots=True)
class PackedWeight:  # (as the CPU kernels' prepared weights)
    qpack: torch.Tensor
    n: int


def test_move_weights_moves_each_storage_once_and_keeps_containers():
    from halserve.platforms.weight_moves import move_weights

    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    model[1].weight = model[0].weight  # tied
    model[0].block_scale = model[0].weight.data[:2]  # a view of a parameter (fp8_block's block_scale)
    model[0].prepared = PackedWeight(torch.randn(4, 4), 4)  # frozen dataclass
    runs = [(None, torch.randn(3), "q4_k")]  # GGUF's runs: a list of tuples
    model[1].runs = runs
    model[1].kv_cache = torch.zeros(5)  # not a weight
    kv_cache = model[1].kv_cache
    before = {name: t.clone() for name, t in _model_tensors(model).items()}
    copied: list[int] = []

    def copy(data: torch.Tensor) -> torch.Tensor:
        copied.append(data.numel())
        return data.clone()

    num_bytes = move_weights(model, copy)
    after = _model_tensors(model)
    # weight, 2 biases, the dataclass's tensor, the run's tensor: the tied weight and the view add none
    assert len(copied) == 5 and num_bytes == sum(copied) == 4 * (64 + 8 + 8 + 16 + 3)
    assert after.keys() == before.keys()
    assert all(torch.equal(after[name], t) and after[name].dtype == t.dtype for name, t in before.items())
    assert model[1].weight is model[0].weight
    assert _storage(model[0].block_scale) == _storage(model[0].weight)
    assert model[0].block_scale.storage_offset() == 0 and model[0].block_scale.shape == (2, 8)
    assert model[1].runs is runs and runs[0][2] == "q4_k"
    assert model[1].kv_cache is kv_cache


@pytest.fixture
def device_offload(monkeypatch):
    """The CPU platform with the base class's offload/restore (what cuda, rocm and xpu run); oneDNN's
    opaque prepacked float weights (no storage to compare) swapped for the torch GEMM."""
    monkeypatch.setattr(CpuPlatform, "offload_weights", Platform.offload_weights)
    monkeypatch.setattr(CpuPlatform, "restore_weights", Platform.restore_weights)
    monkeypatch.setenv("HALSERVE_KERNELS", "gemm=torch")


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> str:
    from model_factory import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("base"), "llama", hidden_size=64, intermediate_size=128,
                           num_heads=4, num_kv_heads=2)


def _deepseek_checkpoint(path: str) -> str:
    """A tiny DeepSeek-V2-Lite-shaped checkpoint (MLA without q LoRA, a dense first layer, 4 experts)."""
    import transformers
    from model_factory import _randomize, make_tokenizer

    config = transformers.DeepseekV2Config(
        vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, q_lora_rank=None,
        intermediate_size=96, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=1, topk_method="greedy", routed_scaling_factor=1.0,
        max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    config.architectures = ["DeepseekV2ForCausalLM"]
    torch.manual_seed(0)
    model = transformers.DeepseekV2ForCausalLM(config).to(torch.float32)
    _randomize(model, 64, 0)
    model.save_pretrained(path)
    make_tokenizer(512).save_pretrained(path)
    return path


def _checkpoint(kind: str, base: str, tmp_path) -> str:
    if kind == "mla":
        return _deepseek_checkpoint(str(tmp_path / "deepseek"))
    from quant_factory import make_ct_checkpoint

    return make_ct_checkpoint(base, str(tmp_path / kind), kind)[0]


def _greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    return [list(out.outputs[0].token_ids) for out in llm.generate(PROMPTS, params, use_tqdm=False)]


def _tensors(value, where: str, depth: int = 4) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor inside ``value``: through lists, tuples, dicts, dataclasses and plain objects."""
    if isinstance(value, torch.Tensor):
        yield where, value
    elif depth == 0 or isinstance(value, (nn.Module, str, bytes, int, float, type)) or callable(value):
        return
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _tensors(item, f"{where}[{i}]", depth - 1)
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _tensors(item, f"{where}[{key!r}]", depth - 1)
    elif dataclasses.is_dataclass(value):
        for f in dataclasses.fields(value):
            yield from _tensors(getattr(value, f.name), f"{where}.{f.name}", depth - 1)
    elif hasattr(value, "__dict__"):
        for name, item in vars(value).items():
            yield from _tensors(item, f"{where}.{name}", depth - 1)


def _model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor the model's modules reach (the KV cache aside: sleep drops it), by path."""
    found = {}
    for prefix, module in model.named_modules():
        for name, value in vars(module).items():
            if name in ("_modules", "kv_cache"):
                continue
            for where, tensor in _tensors(value, f"{prefix}.{name}"):
                if tensor.layout == torch.strided and tensor.untyped_storage().nbytes():
                    found[where] = tensor
    return found


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def _runner(llm: LLM):
    return llm.llm_engine.core.executor.worker.model_runner


@pytest.mark.slow  # an engine per layer kind (2-5 s each)
@pytest.mark.parametrize("kind", list(KIND_ATTRIBUTES))
def test_level_1_offload_moves_every_weight_and_wake_up_drops_the_host_copies(kind, base, tmp_path,
                                                                                device_offload):
    llm = LLM(_checkpoint(kind, base, tmp_path), **ENGINE_KWARGS)
    try:
        model = _runner(llm).model
        before = _greedy(llm)
        awake = _model_tensors(model)
        attribute = KIND_ATTRIBUTES[kind]
        assert any(path.endswith(f".{attribute}") for path in awake), f"no module keeps a {attribute} tensor"
        # (the storages, not the tensors: a Parameter keeps its object and changes its data; held, so
        # that no address is reused while asleep)
        awake_storages = [t.untyped_storage() for t in awake.values()]
        awake_addresses = {s.data_ptr() for s in awake_storages}

        llm.sleep(level=1)
        gc.collect()
        asleep = _model_tensors(_runner(llm).model)
        assert asleep.keys() == awake.keys()
        held = sorted(path for path, t in asleep.items() if _storage(t) in awake_addresses)
        assert not held, f"still on the device after sleep(1): {held[:8]}"
        host_copies = [StorageWeakRef(t.untyped_storage()) for t in asleep.values()]
        # shared storages moved as one
        assert len({_storage(t) for t in asleep.values()}) == len(awake_addresses)
        del awake, asleep, awake_storages

        llm.wake_up()
        gc.collect()
        alive = sum(not ref.expired() for ref in host_copies)
        assert alive == 0, f"{alive} host copies of the weights outlived wake_up"
        restored = _model_tensors(_runner(llm).model)
        assert len({_storage(t) for t in restored.values()}) == len(awake_addresses), \
            "a weight is held twice after wake_up"
        assert _greedy(llm) == before
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.slow  # an engine and three checkpoint loads (~2.5 s)
def test_update_weights_asleep_at_level_1_keeps_the_new_weights_in_host_memory(base, tmp_path, device_offload,
                                                                               monkeypatch):
    from model_factory import make_checkpoint

    other = make_checkpoint(tmp_path / "other", "llama", hidden_size=64, intermediate_size=128, num_heads=4,
                            num_kv_heads=2, seed=1)
    offloaded: list[set[int]] = []  # the storages each offload_weights left the model in

    def recording_offload(platform, model) -> None:
        Platform.offload_weights(platform, model)
        offloaded.append({_storage(t) for t in _model_tensors(model).values()})

    llm = LLM(base, **ENGINE_KWARGS)
    try:
        worker = llm.llm_engine.core.executor.worker
        first = _greedy(llm)
        llm.update_weights(other)  # awake: the reference outputs of ``other``
        second = _greedy(llm)
        assert second != first

        monkeypatch.setattr(CpuPlatform, "offload_weights", recording_offload)
        llm.sleep(level=1)
        old_host = [StorageWeakRef(t.untyped_storage()) for t in _model_tensors(worker.model_runner.model).values()]
        llm.update_weights(base)  # asleep at level 1: loaded, then to host memory like the old weights
        gc.collect()
        assert llm.is_sleeping() and worker.sleep_state.weights_offloaded
        assert len(offloaded) == 2
        now = {_storage(t) for t in _model_tensors(worker.model_runner.model).values()}
        assert now == offloaded[1], "the new weights are not where offload_weights put them"
        assert all(ref.expired() for ref in old_host), "the old weights' host copies outlived update_weights"

        llm.wake_up()
        assert _greedy(llm) == first
    finally:
        llm.llm_engine.shutdown()
