"""Multi-LoRA serving: adapters in PEFT's format, many per engine, mixed in one batch.

    request.py     LoRARequest (what a user passes per request)
    peft.py        reading and validating adapter_config.json + adapter_model.safetensors
    layers.py      LoRA-wrapped linear layers (tensor-parallel aware) and the per-step LoRABatch
    manager.py     the worker side: wrapping the model, adapter LRU, per-step token mapping
    admission.py   the scheduler side: at most max_loras adapters per step, without starvation
"""
from halserve.lora.request import LoRARequest

__all__ = ["LoRARequest"]
