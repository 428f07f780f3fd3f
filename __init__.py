"""Makes ``import halserve`` work from the folder that holds a clone named ``halserve/``.

The package's code lives in root folders (``core/`` is ``halserve``, ``platforms/`` is
``halserve.platforms``, ...; setup.py's ROOTS), which ``pip install -e .`` maps through an
import finder that Python consults *last*. A script in the clone's parent folder has that
folder on ``sys.path``, so Python finds the clone itself first. Without this file it would
take the clone for a namespace package, and ``from halserve import LLM`` would fail with
``cannot import name 'LLM' from 'halserve' (unknown location)``.

With this file, Python imports the clone folder as a regular package, and this module turns
itself into the real one: ``__path__`` lists ``core/`` (the top-level modules, e.g.
``halserve.scheduler``) and the clone's root (every other root folder is named after the last
part of its import name, so ``halserve.platforms`` is ``<root>/platforms``), and
``core/__init__.py`` runs in this namespace. ``halserve.__file__`` is then
``<root>/core/__init__.py``, as it is through the installed finder.

Imported under any other name (pytest or a type checker taking the clone's root for a
package named after its folder), this file does nothing. It is not part of the wheel:
setup.py packages only the ROOTS folders.
"""

if __name__ == "halserve":
    import os as _os

    _root = _os.path.dirname(_os.path.abspath(__file__))
    __file__ = _os.path.join(_root, "core", "__init__.py")
    __path__ = [_os.path.join(_root, "core"), _root]
    if __spec__ is not None:  # keep the spec consistent for importlib.reload and tools
        __spec__.origin = __file__
        __spec__.submodule_search_locations = __path__
    with open(__file__, "rb") as _fh:
        _code = compile(_fh.read(), __file__, "exec")
    del _os, _root, _fh
    exec(_code)
    del _code
