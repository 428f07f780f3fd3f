"""A model's embedding defaults (vLLM's ``PoolerConfig``): which pooling its embeddings use and
whether they are normalized.

Resolved once, when the model is loaded (``get_model_info``), from, in order:

    1. the user's override: ``--pooler-config '{"pooling_type": "MEAN"}'``, ``LLM(..., pooler_config={...})``
    2. the checkpoint's sentence-transformers files: ``modules.json`` lists the modules applied
       after the transformer, e.g. ``sentence_transformers.models.Pooling`` (folder ``1_Pooling``,
       whose ``config.json`` sets one ``pooling_mode_*`` flag) and ``...models.Normalize``
    3. LAST pooling, normalized

A request's ``PoolingParams`` may still set ``normalize`` (and ``pooling_type``) itself.
"""
from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from halserve.config_json import json_object
from halserve.pooling_params import POOLING_TYPES

logger = logging.getLogger(__name__)

ST_MODULES_FILE = "modules.json"
ST_POOLING = "sentence_transformers.models.Pooling"
ST_NORMALIZE = "sentence_transformers.models.Normalize"
ST_TRANSFORMER = "sentence_transformers.models.Transformer"
# sentence-transformers' pooling flags -> halserve's pooling type (None: not supported)
ST_POOLING_MODES: dict[str, str | None] = {
    "pooling_mode_lasttoken": "LAST",
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_cls_token": "CLS",
    "pooling_mode_max_tokens": None,
    "pooling_mode_mean_sqrt_len_tokens": None,
    "pooling_mode_weightedmean_tokens": None,
}
OVERRIDE_HINT = "--pooler-config '{\"pooling_type\": \"MEAN\"}' (LLM(..., pooler_config={\"pooling_type\": \"MEAN\"}))"


class PoolerConfig(BaseModel):
    """How embeddings are pooled; unset fields come from the checkpoint (see the module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    pooling_type: str | None = None
    """LAST, MEAN or CLS (any case)."""
    normalize: bool | None = None
    """Scale embeddings to unit L2 norm (a request's ``normalize`` still wins)."""

    @field_validator("pooling_type", mode="before")
    @classmethod
    def _pooling_type(cls, value: object) -> object:
        if value is None:
            return None
        if not isinstance(value, str) or value.upper() not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {value!r}")
        return value.upper()

    @field_validator("normalize", mode="before")
    @classmethod
    def _normalize(cls, value: object) -> object:
        if value is not None and not isinstance(value, bool):
            raise ValueError(f"normalize must be true or false, got {value!r}")
        return value

    @classmethod
    def parse(cls, value: Any) -> PoolerConfig:
        """A PoolerConfig from itself, a dict or a JSON object string; ValueError naming the
        bad field and what it accepts."""
        if isinstance(value, cls):
            return value
        value = json_object(value, "pooler config", '{"pooling_type": "MEAN", "normalize": false}')
        try:
            return cls(**value)
        except ValidationError as exc:
            raise ValueError("; ".join(_describe(err) for err in exc.errors(include_url=False))) from None


def _describe(err: Mapping[str, Any]) -> str:
    name = ".".join(str(part) for part in err["loc"])
    if err["type"] == "extra_forbidden":
        return f"pooler config has no field {name!r}; its fields are {', '.join(PoolerConfig.model_fields)}"
    return str(err["msg"]).removeprefix("Value error, ")


def resolve_pooler_config(model_path: str, override: PoolerConfig | None) -> PoolerConfig:
    """The model's pooler config with both fields set: ``override``'s, else the checkpoint's
    sentence-transformers defaults, else LAST and normalized. ValueError when the checkpoint
    asks for a pooling mode halserve lacks and ``override`` does not choose another."""
    override = override or PoolerConfig()
    if override.pooling_type is not None and override.normalize is not None:
        return override
    found = sentence_transformers_defaults(model_path, needs_pooling_type=override.pooling_type is None)
    pooling_type = override.pooling_type or found.get("pooling_type") or "LAST"
    normalize = override.normalize if override.normalize is not None else found.get("normalize", True)
    return PoolerConfig(pooling_type=pooling_type, normalize=normalize)


def sentence_transformers_defaults(model_path: str, needs_pooling_type: bool = True) -> dict[str, Any]:
    """``pooling_type`` and ``normalize`` as the checkpoint's sentence-transformers modules set
    them; an empty dict when it has no ``modules.json``. With ``needs_pooling_type`` an
    unsupported pooling mode is a ValueError (otherwise the caller overrides it)."""
    modules = _read_json(os.path.join(model_path, ST_MODULES_FILE))
    if modules is None:
        return {}
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise ValueError(f"{os.path.join(model_path, ST_MODULES_FILE)} is not a list of modules")
    types = [str(m.get("type", "")) for m in modules]
    ignored = [t for t in types if t not in (ST_TRANSFORMER, ST_POOLING, ST_NORMALIZE)]
    if ignored:
        logger.warning("the checkpoint's sentence-transformers modules %s are not applied: its embeddings will "
                       "differ from sentence-transformers'", ", ".join(ignored))
    found: dict[str, Any] = {"normalize": ST_NORMALIZE in types}
    pooling = next((m for m in modules if m.get("type") == ST_POOLING), None)
    if pooling is not None:
        config_path = os.path.join(model_path, str(pooling.get("path", "")), "config.json")
        mode = _pooling_type(_read_json(config_path) or {}, config_path, needs_pooling_type)
        if mode is not None:
            found["pooling_type"] = mode
    return found


def _pooling_type(config: dict[str, Any], config_path: str, strict: bool) -> str | None:
    modes = [name for name in ST_POOLING_MODES if config.get(name) is True]
    if len(modes) == 1 and ST_POOLING_MODES[modes[0]] is not None:
        return ST_POOLING_MODES[modes[0]]
    if not strict:
        return None
    what = f"pooling mode {' + '.join(modes)}" if modes else "no pooling mode (no pooling_mode_* flag is true)"
    supported = ", ".join(f"{name} ({kind})" for name, kind in ST_POOLING_MODES.items() if kind is not None)
    raise ValueError(f"the checkpoint's sentence-transformers pooling ({config_path}) sets {what}, which halserve "
                     f"does not support (it supports {supported}); choose a pooling type with {OVERRIDE_HINT}")


def _read_json(path: str) -> Any:
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)
