"""pytest plugin of the conformance kit (registered through the ``pytest11`` entry point).

    pytest --halserve-conformance=PLUGIN [--halserve-conformance-platform=P] [--halserve-conformance-quick]

adds one test item per row of the capability matrix: passed rows pass, failed rows fail
with the kit's message (op, kernel, case, error vs tolerance), declined rows are skipped
with their reason. Without the option this plugin does nothing and imports nothing heavy.
The kit runs once, when the items are collected.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:  # pragma: no cover
    from _pytest._code.code import TerminalRepr

OPTION = "--halserve-conformance"


def pytest_addoption(parser: Any) -> None:
    group = parser.getgroup("halserve", "halserve conformance kit")
    group.addoption(OPTION, action="store", default=None, metavar="PLUGIN",
                    help="run the halserve conformance kit on the installed plugin PLUGIN (entry-point name)")
    group.addoption(OPTION + "-platform", action="store", default=None, metavar="P",
                    help="test the plugin's kernels and backends on platform P")
    group.addoption(OPTION + "-quick", action="store_true", default=False, help="trimmed grids")


def pytest_configure(config: Any) -> None:
    plugin = config.getoption(OPTION)
    if not plugin:
        return
    # before any test module imports Triton kernels: decide on TRITON_INTERPRET now
    from halserve.plugins import get_plugin_manager
    from halserve.plugins.testing import prepare_interpreter

    manager = get_plugin_manager()
    if manager.record(plugin) is None:
        raise pytest.UsageError(
            f"{OPTION}={plugin}: no such plugin; installed: {', '.join(r.name for r in manager.records)}"
        )
    prepare_interpreter(manager, plugin, config.getoption(OPTION + "-platform"))


def pytest_collection_modifyitems(session: Any, config: Any, items: list) -> None:
    plugin = config.getoption(OPTION)
    if not plugin:
        return
    collector = ConformanceCollector.from_parent(session, name=f"halserve-conformance[{plugin}]")
    items.extend(collector.collect())


class ConformanceCollector(pytest.Collector):
    def collect(self) -> list:
        from halserve.plugins.testing import ConformanceSetupError, run_conformance

        config = self.config
        plugin = config.getoption(OPTION)
        try:
            report = run_conformance(plugin, platform=config.getoption(OPTION + "-platform"),
                                     quick=config.getoption(OPTION + "-quick"))
        except ConformanceSetupError as exc:
            raise pytest.UsageError(f"{OPTION}={plugin}: {exc}") from exc
        items = []
        seen: dict[str, int] = {}
        for result in report.results:
            name = f"{result.check}[{result.subject}][{result.case}]"
            seen[name] = seen.get(name, 0) + 1
            if seen[name] > 1:
                name += f"#{seen[name]}"
            items.append(ConformanceItem.from_parent(self, name=name, result=result))
        return items


class ConformanceFailure(AssertionError):
    pass


class ConformanceItem(pytest.Item):
    def __init__(self, *, result: Any, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.result = result

    def runtest(self) -> None:
        r = self.result
        if r.status == "declined":
            pytest.skip(f"declined: {r.detail}")
        if r.status == "failed":
            raise ConformanceFailure(r.detail)
        if r.status == "warned":
            import warnings

            warnings.warn(f"halserve conformance [{r.check}] {r.subject} ({r.case}): {r.detail}", UserWarning,
                          stacklevel=1)

    def repr_failure(self, excinfo: Any, style: Any = None) -> str | TerminalRepr:
        if isinstance(excinfo.value, ConformanceFailure):
            r = self.result
            return f"[{r.check}] {r.subject} ({r.case}) FAILED:\n{r.detail}"
        return super().repr_failure(excinfo)

    def reportinfo(self) -> tuple:
        return "halserve-conformance", None, self.name
