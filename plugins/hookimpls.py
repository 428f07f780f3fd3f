"""A plugin's hook implementations, found and checked before anything of it is registered.

halserve takes as a hook implementation every function of a plugin that is marked with
``halserve.plugins.hookimpl`` or whose name starts with ``halserve_`` (as pytest does for
``pytest_``), and refuses the whole plugin when one of them

- names no hook of ``halserve.plugins.hookspecs`` (a misspelling such as
  ``halserve_platfroms``), unless it is marked ``hookimpl(optionalhook=True)``;
- takes an argument the hook does not pass (hooks are called with keyword arguments; an
  implementation may take any subset of the hook's arguments and nothing else);
- is a wrapper (``wrapper=True`` / ``hookwrapper=True``): halserve calls each plugin's
  contribution hooks on their own, so there is nothing to wrap;
- or when an attribute named like a hook is not a function (``halserve_platforms = [...]``).

pluggy checks argument names again at ``register``; checking first lets halserve name the
hook in one line and register nothing of a bad plugin.
"""
from __future__ import annotations

import difflib
import inspect
from dataclasses import dataclass
from typing import Any

import pluggy

from halserve.plugins import hookspecs

HOOK_PREFIX = "halserve_"


class HookManager(pluggy.PluginManager):
    """pluggy's manager with halserve's hookspecs, also taking unmarked ``halserve_*`` functions."""

    def __init__(self) -> None:
        super().__init__(hookspecs.PROJECT)
        self.add_hookspecs(hookspecs)

    def parse_hookimpl_opts(self, plugin: Any, name: str) -> pluggy.HookimplOpts | None:
        opts = super().parse_hookimpl_opts(plugin, name)
        if opts is None and name.startswith(HOOK_PREFIX) and inspect.isroutine(getattr(plugin, name, None)):
            # what an unmarked function means: a plain hookimpl (what ``@hookimpl`` gives)
            return pluggy.HookimplOpts(
                wrapper=False, hookwrapper=False, optionalhook=False, tryfirst=False, trylast=False, specname=None,
            )
        return opts

    def hook_names(self) -> list[str]:
        """The names of the hooks that have a spec, sorted."""
        return sorted(name for name, caller in vars(self.hook).items() if caller.has_spec())


@dataclass(frozen=True, slots=True)
class FoundHook:
    hook: str  # the hook it implements (its ``specname``, else the attribute's name)
    attr: str  # the plugin's attribute holding it
    impl: pluggy.HookImpl


def find_hookimpls(pm: HookManager, name: str, plugin: Any) -> list[FoundHook]:
    """Every hook implementation of ``plugin`` (registered as ``name``), unchecked; registers nothing."""
    found = []
    for attr in dir(plugin):
        opts = pm.parse_hookimpl_opts(plugin, attr)
        if opts is not None:
            impl = pluggy.HookImpl(plugin, name, getattr(plugin, attr), opts)
            found.append(FoundHook(opts.get("specname") or attr, attr, impl))
    return found


def check_hookimpls(pm: HookManager, name: str, plugin: Any, found: list[FoundHook]) -> None:
    """Raise ``pluggy.PluginValidationError`` naming the first of ``found`` that halserve would refuse."""
    known = pm.hook_names()
    taken: dict[str, str] = {}
    for item in found:
        caller = getattr(pm.hook, item.hook, None)
        spec = caller.spec if caller is not None else None
        if spec is None:
            if item.impl.optionalhook:
                continue
            close = difflib.get_close_matches(item.hook, known, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise pluggy.PluginValidationError(
                plugin,
                f"plugin {name!r} defines {item.attr}, which is not a halserve hook{hint}; "
                f"the hooks are {', '.join(known)} (halserve.plugins.hookspecs)",
            )
        if item.hook in taken:
            raise pluggy.PluginValidationError(
                plugin, f"plugin {name!r} implements {item.hook} twice ({taken[item.hook]} and {item.attr}); keep one",
            )
        taken[item.hook] = item.attr
        if item.impl.wrapper or item.impl.hookwrapper:
            raise pluggy.PluginValidationError(
                plugin,
                f"plugin {name!r}: {item.attr} is a hook wrapper; halserve calls each plugin's hooks "
                "on their own, so implement it as a plain @hookimpl",
            )
        extra = [arg for arg in item.impl.argnames if arg not in spec.argnames]
        if extra:
            raise pluggy.PluginValidationError(
                plugin,
                f"plugin {name!r}: {item.attr}({', '.join(item.impl.argnames)}) takes {', '.join(extra)}, "
                f"which {item.hook}({', '.join(spec.argnames)}) does not pass; hooks are called with "
                "keyword arguments and an implementation may take only the hook's own arguments",
            )
    for hook in known:
        value = getattr(plugin, hook, None)
        if value is not None and not inspect.isroutine(value):
            raise pluggy.PluginValidationError(
                plugin, f"plugin {name!r}: {hook} is a {type(value).__name__}, not a function; "
                "write it as a function returning the value",
            )
