"""Executors: how workers are started: ``uni`` (in-process), ``mp`` (one process per rank on this
machine), ``ray`` (Ray actors in a placement group, on this machine or a cluster)."""
from halserve.executors.base import Executor

__all__ = ["Executor"]
