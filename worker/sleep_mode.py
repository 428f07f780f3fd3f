"""Sleep mode (vLLM's): a worker hands its KV cache, or its weights and KV cache, back to the OS
or the device driver between bursts of work, and takes them back.

    level  sleep                                          wake_up
    1      KV cache dropped; weights to host memory       weights back on the device (the CPU: no-op);
           (Platform.offload_weights; the CPU: no-op,      KV cache reallocated, zeroed
           they already live there)
    2      KV cache and weights dropped                   weights reloaded from the checkpoint (or the
                                                          one update_weights last loaded); KV cache
                                                          reallocated, zeroed

Both end with ``Platform.release_memory`` (CPU: ``gc.collect`` and glibc's ``malloc_trim(0)``, so
the process's RSS really drops; CUDA/ROCm: ``torch.cuda.empty_cache`` and torch's pinned host
cache). Level 1's offload moves every tensor holding a weight, module attributes included (repacked
quantized weights, MLA's absorbed matrices: halserve.platforms.weight_moves); ``wake_up`` drops the
host copies again. ``update_weights(path)`` loads a checkpoint of the same architecture into a new
model and swaps it in only once it loaded: a mismatch is a ValueError and the old weights keep
serving. The peak is old + new weights while awake. Asleep, the new weights take the old ones'
place: at level 1 they go to host memory as soon as they loaded (the device holds them only while
they load; the old host copies are dropped), at level 2 they stay resident (``wake_up`` then only
reallocates the KV cache).

The engine core (halserve.engine.core) calls these through the executor's ``collective_rpc`` on
every rank, only while no request is unfinished; it resets the prefix cache first (the cached K/V
is gone) and refuses requests while asleep.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from halserve.config import EngineConfig
    from halserve.models.loader import ModelInfo
    from halserve.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

# What a checkpoint given to update_weights must share with the served one (HF config keys of the
# decoder): they fix the tensors' shapes and the engine's view of the model (vocabulary, KV cache).
SHAPE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "tie_word_embeddings", "moe_intermediate_size", "num_experts",
              "n_routed_experts", "num_local_experts", "kv_lora_rank", "sliding_window")


@dataclass
class SleepState:
    """One worker's sleep: its level and what it dropped."""

    config: EngineConfig  # loads the weights at a level-2 wake_up (update_weights replaces it)
    info: ModelInfo  # ditto (its model_path)
    level: int = 0  # 0: awake
    kv_dropped: bool = False
    weights_dropped: bool = False
    weights_offloaded: bool = False  # (level 1 on a device: in host memory)
    had_graphs: bool = False  # decode steps were replayed from graphs: capture them again
    lora_requests: list[Any] = field(default_factory=list)  # adapters to load again with the weights


def sleep(runner: ModelRunner, state: SleepState, level: int) -> None:
    """Drop the KV cache (and at level 2 the weights) and release the memory. Sleeping at a level
    no deeper than the current one changes nothing; level 2 after level 1 drops the weights too."""
    if level not in (1, 2):
        raise ValueError(f"sleep level must be 1 (drop the KV cache, keep the weights in host memory) or 2 "
                         f"(drop the weights too), got {level!r}")
    if level <= state.level:
        return
    if not state.kv_dropped:
        state.had_graphs = runner.step_graphs is not None
        runner.step_graphs = None  # (its graphs read the KV cache and the weights)
        for layer in runner.model.attention_layers:
            layer.kv_cache = None
        runner.kv_caches = []
        state.kv_dropped = True
    if level == 2:
        manager = runner.lora_manager
        state.lora_requests = manager.lora_requests() if manager is not None else []
        runner.lora_manager = None
        runner.model = None
        state.weights_dropped, state.weights_offloaded = True, False
    elif not state.weights_offloaded:
        runner.platform.offload_weights(runner.model)
        state.weights_offloaded = True
    state.level = level
    runner.platform.release_memory()
    logger.info("asleep at level %d: %s", level, "KV cache and weights released" if level == 2 else
                "KV cache released, weights in host memory")


def wake_up(runner: ModelRunner, state: SleepState) -> None:
    """Take back what ``sleep`` dropped (a no-op when awake)."""
    if state.weights_dropped:
        _install(runner, state, _load(runner, state.config, state.info))
    elif state.weights_offloaded:
        runner.platform.restore_weights(runner.model)
        state.weights_offloaded = False
    if state.kv_dropped:
        runner.initialize_kv_cache(runner.num_blocks)
        state.kv_dropped = False
        if state.had_graphs:
            runner.capture_graphs()
    state.level = 0


def update_weights(runner: ModelRunner, state: SleepState, path: str) -> None:
    """Serve the weights of the checkpoint folder ``path`` (the same architecture and sizes). Loads
    them into a new model and swaps it in; any mismatch is a ValueError and the old weights stay."""
    config, info = _checked_checkpoint(runner, path)
    try:
        model = _load(runner, config, info)
    except Exception as exc:  # noqa: BLE001 - missing tensors, wrong shapes: the caller's checkpoint
        runner.platform.release_memory()  # (what the new model had loaded)
        what = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
        raise ValueError(f"update_weights: checkpoint {path!r} could not be loaded: {what}; the old weights "
                         "keep serving") from None
    old = runner.model
    # (layer i of the new model takes layer i's KV-cache tensor; none while asleep)
    bindings = [] if old is None or state.kv_dropped else \
        [(layer.kv_cache, getattr(layer, "kv_cache_group", None)) for layer in old.attention_layers]
    if old is not None:
        manager = runner.lora_manager
        state.lora_requests = manager.lora_requests() if manager is not None else []
    had_graphs = runner.step_graphs is not None
    was_offloaded = state.weights_offloaded
    runner.model = runner.lora_manager = runner.step_graphs = None
    del old
    state.config, state.info = config, info
    _install(runner, state, model)
    if was_offloaded:  # asleep at level 1: the new weights wait in host memory as the old ones did
        runner.platform.offload_weights(model)
        state.weights_offloaded = True
    for layer, (cache, group) in zip(model.attention_layers, bindings):
        layer.kv_cache = cache
        if group is not None:
            layer.kv_cache_group = group
    if bindings:
        runner.kv_caches = [layer.kv_cache for layer in model.attention_layers]
        if had_graphs:
            runner.capture_graphs()
    runner.platform.release_memory()  # (the old weights, on the device or in host memory)
    logger.info("weights updated from %s%s", path, " (kept in host memory until wake_up)" if was_offloaded else "")


def _install(runner: ModelRunner, state: SleepState, model: Any) -> None:
    runner.model = model
    if runner.config.enable_lora:
        from halserve.lora.manager import LoRAManager

        runner.lora_manager = LoRAManager(model, runner.config, runner.device, runner.info.dtype)
        for lora in state.lora_requests:
            runner.lora_manager.add(lora)
    state.lora_requests = []
    state.weights_dropped = state.weights_offloaded = False


def _load(runner: ModelRunner, config: EngineConfig, info: ModelInfo) -> Any:
    from halserve.models.loader import load_model

    return load_model(config, info, runner.platform, runner.attn_backend_cls, progress=False)


def _checked_checkpoint(runner: ModelRunner, path: Any) -> tuple[EngineConfig, ModelInfo]:
    """The config and model info to load ``path`` with; ValueError naming what does not match."""
    keep = "; the old weights keep serving"
    if not isinstance(path, str) or not path:
        raise ValueError(f"update_weights needs the path of a checkpoint folder (a string), got {path!r}")
    if runner.info.gguf_file is not None:
        raise ValueError(f"update_weights reads safetensors checkpoint folders, but this engine serves the GGUF "
                         f"file {runner.info.gguf_file!r}{keep}")
    if not os.path.isdir(path) or not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"update_weights: {path!r} is not a checkpoint folder (a directory holding config.json "
                         f"and *.safetensors){keep}")
    from transformers import AutoConfig

    try:
        hf_config = AutoConfig.from_pretrained(path, trust_remote_code=runner.config.trust_remote_code)
    except Exception as exc:  # noqa: BLE001 - transformers' errors vary: name it, keep serving
        raise ValueError(f"update_weights: cannot read {path!r}/config.json ({type(exc).__name__}: {exc}){keep}") \
            from None
    served = runner.info.hf_config
    problems = []
    arch = (getattr(hf_config, "architectures", None) or [None])[0]
    if arch != runner.info.architecture:
        problems.append(f"architecture {arch} (served: {runner.info.architecture})")
    new_text, old_text = _text_config(hf_config), _text_config(served)
    for key in SHAPE_KEYS:
        new, old = getattr(new_text, key, None), getattr(old_text, key, None)
        if new != old:
            problems.append(f"{key} {new} (served: {old})")
    new_quant, old_quant = (_quant_method(c) for c in (hf_config, served))
    if new_quant != old_quant:
        problems.append(f"quantization {new_quant or 'none'} (served: {old_quant or 'none'})")
    if problems:
        raise ValueError(f"update_weights: checkpoint {path!r} does not match the served model: "
                         f"{'; '.join(problems)}{keep}")
    config = runner.config.model_copy(update={"model": path, "load_format": "auto"})
    info = dataclasses.replace(runner.info, model_path=path, hf_config=hf_config)
    return config, info


def _text_config(hf_config: Any) -> Any:
    return hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config


def _quant_method(hf_config: Any) -> str | None:
    quant = getattr(hf_config, "quantization_config", None)
    if quant is None:
        return None
    return quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", str(quant))
