"""The halserve conformance kit: checks any plugin's platforms, kernels and attention
backends against halserve's torch references, and a whole engine run against the CPU.

    halserve conformance PLUGIN [--platform P] [--json] [--quick]
    pytest --halserve-conformance=PLUGIN
    from halserve.plugins.testing import run_conformance, prepare_interpreter

See docs/plugins.md ("Conformance") for what is checked and how to read the results.
"""
from halserve.plugins.testing.results import CheckResult, ConformanceReport
from halserve.plugins.testing.runner import CHECKS, ConformanceSetupError, run_conformance
from halserve.plugins.testing.target import prepare_interpreter

__all__ = [
    "CHECKS",
    "CheckResult",
    "ConformanceReport",
    "ConformanceSetupError",
    "prepare_interpreter",
    "run_conformance",
]
