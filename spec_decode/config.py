"""``speculative_config``: which drafter proposes tokens and how many (vLLM's names)."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from halserve.config_json import json_object

SPEC_METHODS = ("ngram", "draft_model")


class SpeculativeConfig(BaseModel):
    """``{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
    "prompt_lookup_min": 1}``: each step, a decoding request whose last ``n`` tokens
    (``prompt_lookup_min <= n <= prompt_lookup_max``, longest first) occurred earlier in its
    prompt or output proposes the up to ``num_speculative_tokens`` tokens that followed
    them there; the model checks them all in one forward.

    ``{"model": "path/or/hub-id", "num_speculative_tokens": 4}`` (``method`` "draft_model",
    implied by ``model``): a smaller model with the same vocabulary proposes the drafts, greedily,
    in the workers (its KV cache shares the target's block tables)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: Literal["ngram", "draft_model"] = "ngram"
    num_speculative_tokens: int = Field(ge=1, le=32)
    model: str | None = None
    """draft_model: the draft checkpoint (a local HF directory or a hub id)."""
    revision: str | None = None
    """draft_model: the draft checkpoint's revision."""
    prompt_lookup_max: int = Field(default=4, ge=1)
    prompt_lookup_min: int | None = Field(default=None, ge=1)
    """None: the same as ``prompt_lookup_max`` (vLLM's default)."""
    disable_by_batch_size: int | None = Field(default=None, ge=1)
    """No drafts in a step that runs at least this many requests: a large batch already keeps the
    device busy, and checking drafts costs compute. None: always draft."""

    @model_validator(mode="after")
    def _lookup_range(self) -> SpeculativeConfig:
        if self.method == "draft_model" and not self.model:
            raise ValueError('speculative_config method "draft_model" needs "model": the draft checkpoint')
        if self.method == "ngram" and self.model is not None:
            raise ValueError('speculative_config "model" is for method "draft_model", not "ngram"')
        if self.prompt_lookup_min is not None and self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) must be <= prompt_lookup_max "
                             f"({self.prompt_lookup_max})")
        return self

    @property
    def min_ngram(self) -> int:
        return self.prompt_lookup_min if self.prompt_lookup_min is not None else self.prompt_lookup_max

    @classmethod
    def parse(cls, value: object) -> SpeculativeConfig:
        """From a dict, a JSON string (``--speculative-config``) or an instance."""
        if isinstance(value, cls):
            return value
        value = json_object(value, "speculative_config", '{"method": "ngram", "num_speculative_tokens": 4}')
        method = value.get("method") or ("draft_model" if value.get("model") else "ngram")
        value = {**value, "method": method}
        if method not in SPEC_METHODS:
            raise ValueError(f"speculative_config method {method!r} is not supported; use one of "
                             f"{', '.join(SPEC_METHODS)}")
        return cls.model_validate(value)
