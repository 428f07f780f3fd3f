"""Executors: how workers are started (``uni`` in-process; ``mp`` and ``ray`` later)."""
from halserve.executor import Executor

__all__ = ["Executor"]
