"""Kernels: one implementation of one named op for some platforms.

A kernel class declares which op it implements (``OPS`` in ``ops.py`` lists them with
their signatures), the platforms it runs on, a priority and the dtypes it accepts, and
answers ``supports(**problem)`` with ``None`` (yes) or a reason (no). Layers resolve
their kernels once, at model load (``resolve_kernel``), never per call.
"""
from __future__ import annotations

from typing import Any, ClassVar

ANY_PLATFORM = "*"


class Kernel:
    op: ClassVar[str]
    """The op implemented, a key of ``halserve.kernels.OPS``."""
    name: ClassVar[str]
    """Unique per op, e.g. ``"triton"``; shown by ``halserve plugins``."""
    platforms: ClassVar[tuple[str, ...]]
    """Platform names this kernel runs on; ``("*",)`` means every platform."""
    priority: ClassVar[int] = 0
    """Higher wins among kernels that support a problem. The torch references are 0."""
    dtypes: ClassVar[tuple[str, ...]] = ("float32", "float16", "bfloat16")
    """Activation dtypes accepted (torch names)."""
    description: ClassVar[str] = ""

    @classmethod
    def supports(cls, **problem: Any) -> str | None:
        """``None`` if this kernel can run ``problem``, else a human reason.

        ``problem`` always has ``dtype`` (a torch dtype name) and the op's own keys
        (see ``OPS[op].problem_keys``). Subclasses override ``_supports`` for checks
        beyond the dtype.
        """
        dtype = problem.get("dtype")
        if dtype is not None and dtype not in cls.dtypes:
            return f"dtype {dtype} not supported (supports {', '.join(cls.dtypes)})"
        return cls._supports(**problem)

    @classmethod
    def _supports(cls, **problem: Any) -> str | None:
        """(optional) default: everything within ``dtypes`` is supported."""
        return None

    @classmethod
    def runs_on(cls, platform: str) -> bool:
        return ANY_PLATFORM in cls.platforms or platform in cls.platforms

    @classmethod
    def describe(cls) -> dict[str, Any]:
        return {
            "op": cls.op,
            "platforms": list(cls.platforms),
            "priority": cls.priority,
            "dtypes": list(cls.dtypes),
            "description": cls.description,
            **cls.capabilities(),
        }

    @classmethod
    def capabilities(cls) -> dict[str, Any]:
        """(optional) default: {}. Extra configuration facts for ``halserve plugins``."""
        return {}

    def prepare_weight(self, weight: Any) -> Any:
        """(optional) default: the weight itself. Called once per layer after loading (never
        per call) for weight-taking ops; what it returns (e.g. a weight repacked into the
        library's blocked layout) is what the layer then passes as the weight on every call.
        A kernel that repacks must still accept an unprepared weight. For ops whose weight
        is several arguments (the 4-bit GEMMs), ``weight`` is the tuple of those arguments
        in call order (everything after ``x``), and the result takes the first one's place."""
        return weight

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"kernel {self.op}/{self.name} has no __call__")

    def __repr__(self) -> str:
        return f"<kernel {self.op}/{self.name}>"
