"""``LoRARequest``: which adapter a request runs with (vLLM's shape and field names).

    LoRARequest(lora_name="sql", lora_int_id=1, lora_path="/adapters/sql")

``lora_int_id`` identifies the adapter inside the engine (worker caches, scheduler slots):
give each adapter its own positive id. ``lora_path`` is a PEFT adapter directory (or a
Hugging Face hub id) holding ``adapter_config.json`` and ``adapter_model.safetensors``.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None
    """The served model it was trained for (the server's ``/v1/models`` ``parent``); informational."""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive int (each adapter its own), got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"LoRA adapter {self.lora_name!r}: lora_path must name the adapter's directory "
                             f"(adapter_config.json + adapter_model.safetensors), got {self.lora_path!r}")

    # vLLM's aliases
    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    @property
    def block_hash_key(self) -> tuple:
        """Prefix-cache extra key: blocks computed under one adapter never serve another."""
        return ("lora", self.lora_int_id, self.lora_name, self.lora_path)
