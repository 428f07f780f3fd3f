"""``halserve.executor``: the import name the executor interface had before it moved beside
its implementations, kept so existing plugins and scripts keep working. The interface is
``halserve.executors.base`` (``executors/base.py``)."""
from halserve.executors.base import Executor, RemoteTraceback, WorkerDiedError

__all__ = ["Executor", "RemoteTraceback", "WorkerDiedError"]
