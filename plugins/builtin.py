"""halserve's platform-independent built-ins, registered like any other plugin:
the torch reference kernels and attention backend, the executors and the models."""
from __future__ import annotations

from halserve.plugins import PluginManifest, hookimpl


@hookimpl
def halserve_manifest() -> PluginManifest:
    return PluginManifest(
        name="builtin",
        version="0.1.0",
        api=">=1,<3",
        description="torch reference kernels and attention, executors, KV connectors, "
                    "Llama/Qwen/Mistral/Gemma/Phi-3/MoE/LLaVA/LLaVA-NeXT/Qwen2-VL/InternVL models",
    )


@hookimpl
def halserve_kernels() -> list[type]:
    from halserve.kernels.reference import REFERENCE_KERNELS

    return list(REFERENCE_KERNELS)


@hookimpl
def halserve_attention_backends() -> list[type]:
    from halserve.attention_backends.torch_ref import TorchAttentionBackend

    return [TorchAttentionBackend]


@hookimpl
def halserve_executors() -> list[type]:
    from halserve.executors.mp import MultiprocExecutor
    from halserve.executors.ray import RayExecutor  # imports ray only when one is built
    from halserve.executors.uni import UniExecutor

    return [UniExecutor, MultiprocExecutor, RayExecutor]


@hookimpl
def halserve_kv_connectors() -> list[type]:
    from halserve.kv_connectors.offloading import OffloadingConnector
    from halserve.kv_connectors.p2p import P2pConnector
    from halserve.kv_connectors.shared_storage import SharedStorageConnector

    return [SharedStorageConnector, OffloadingConnector, P2pConnector]


@hookimpl
def halserve_model_architectures() -> dict[str, str]:
    return {
        "BambaForCausalLM": "halserve.models.bamba:BambaForCausalLM",
        "DeepseekV2ForCausalLM": "halserve.models.deepseek:DeepseekForCausalLM",
        "DeepseekV3ForCausalLM": "halserve.models.deepseek:DeepseekForCausalLM",
        "GemmaForCausalLM": "halserve.models.gemma:GemmaForCausalLM",
        "Gemma2ForCausalLM": "halserve.models.gemma:GemmaForCausalLM",
        "Gemma3ForCausalLM": "halserve.models.gemma:GemmaForCausalLM",
        "InternVLForConditionalGeneration": "halserve.models.internvl:InternVLForConditionalGeneration",
        "LlamaForCausalLM": "halserve.models.llama:LlamaForCausalLM",
        "LlavaForConditionalGeneration": "halserve.models.llava:LlavaForConditionalGeneration",
        "LlavaNextForConditionalGeneration": "halserve.models.llava_next:LlavaNextForConditionalGeneration",
        "MistralForCausalLM": "halserve.models.llama:LlamaForCausalLM",
        "MixtralForCausalLM": "halserve.models.mixtral:MixtralForCausalLM",
        "Phi3ForCausalLM": "halserve.models.phi3:Phi3ForCausalLM",
        "Qwen2ForCausalLM": "halserve.models.llama:LlamaForCausalLM",
        "Qwen2MoeForCausalLM": "halserve.models.qwen_moe:QwenMoeForCausalLM",
        "Qwen2VLForConditionalGeneration": "halserve.models.qwen2_vl:Qwen2VLForConditionalGeneration",
        "Qwen2_5_VLForConditionalGeneration": "halserve.models.qwen2_vl:Qwen2_5_VLForConditionalGeneration",
        "Qwen3ForCausalLM": "halserve.models.llama:LlamaForCausalLM",
        "Qwen3MoeForCausalLM": "halserve.models.qwen_moe:QwenMoeForCausalLM",
        # classifiers and reward models (LLM.classify, POST /classify)
        "LlamaForSequenceClassification": "halserve.models.sequence_classification:LlamaForSequenceClassification",
        "MistralForSequenceClassification": "halserve.models.sequence_classification:LlamaForSequenceClassification",
        "Qwen2ForSequenceClassification": "halserve.models.sequence_classification:LlamaForSequenceClassification",
        "Qwen3ForSequenceClassification": "halserve.models.sequence_classification:LlamaForSequenceClassification",
    }


@hookimpl
def halserve_quant_methods() -> list[type]:
    from halserve.quant_methods.awq import AwqLinearMethod
    from halserve.quant_methods.compressed_tensors import CompressedTensorsMethod
    from halserve.quant_methods.fp8 import Fp8LinearMethod
    from halserve.quant_methods.gguf import GgufLinearMethod
    from halserve.quant_methods.gptq import GptqLinearMethod
    from halserve.quant_methods.unquantized import UnquantizedLinearMethod

    return [UnquantizedLinearMethod, GptqLinearMethod, AwqLinearMethod, CompressedTensorsMethod, Fp8LinearMethod,
            GgufLinearMethod]
