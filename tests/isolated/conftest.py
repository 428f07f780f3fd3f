"""The isolated suites: tests/isolated/ipex and tests/isolated/xla run INSIDE their own
virtual environments (IPEX pins torch 2.8, torch-xla pins torch 2.9), built by
``scripts/isolated_env.py``. In any other interpreter (the default suite on torch 2.13)
those folders are not collected; ``test_isolated_suites.py`` builds the venvs and runs
them in a subprocess instead.
"""
import importlib.util
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # paged_scenario

collect_ignore_glob = []
if importlib.util.find_spec("intel_extension_for_pytorch") is None:
    collect_ignore_glob.append("ipex/*")
if importlib.util.find_spec("torch_xla") is None:
    collect_ignore_glob.append("xla/*")
