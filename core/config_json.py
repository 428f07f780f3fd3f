"""Configuration objects given as JSON text (a CLI flag such as ``--pooler-config``) or as a dict
(``LLM(pooler_config={...})``): one reading, one kind of error message."""
from __future__ import annotations

import json


def json_object(value: object, name: str, example: str) -> dict:
    """``value`` as a dict: a dict as is, a string parsed as a JSON object; ValueError naming
    ``name`` and showing ``example`` (a JSON object) otherwise."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{name} is not valid JSON ({exc.msg}): {value!r}; e.g. '{example}'") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a dict or a JSON object, e.g. '{example}'; got {value!r}")
    return value
