"""A plugin's manifest: who it is and which plugin-API versions it speaks."""
from __future__ import annotations

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from pydantic import BaseModel, ConfigDict, field_validator


class PluginManifest(BaseModel):
    """Returned by every plugin's ``halserve_manifest`` hook."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    """Human name of the plugin (usually the entry-point name)."""
    version: str
    """The plugin's own version."""
    api: str
    """Supported halserve plugin-API range, a PEP 440 specifier such as ``">=1,<2"``."""
    description: str = ""
    """One line saying what the plugin contributes."""

    @field_validator("api")
    @classmethod
    def _valid_range(cls, value: str) -> str:
        try:
            SpecifierSet(value)
        except InvalidSpecifier as exc:
            raise ValueError(
                f"manifest api range {value!r} is not a valid version specifier; "
                "write it like '>=1,<2'"
            ) from exc
        return value

    def supports_api(self, api_version: int) -> bool:
        return SpecifierSet(self.api).contains(str(api_version))
