"""halserve-plugin-example: a complete, minimal halserve plugin for a (CPU-backed) device.

Modules: ``plugin`` (the hooks halserve calls), ``platform`` (``ExamplePlatform``),
``attention`` (``ExampleAttentionBackend``), ``kernels`` (``ExampleGemm``), and for plugin API 2
``layers`` (``ExampleRMSNorm``, a layer override), ``models`` (``ExampleLlamaForCausalLM``, a model
variant) and ``communicator`` (``ExampleCommunicator``). Nothing here
touches a device at import time: halserve imports this package on every start.
"""
__version__ = "0.2.0"
