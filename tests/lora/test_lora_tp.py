"""LoRA under tensor parallelism (the ``mp`` executor, two CPU ranks over gloo): the same
tokens as one rank and as the merged checkpoints. Each rank holds its slice of every
adapter (B's rows of column-parallel layers, A's columns of row-parallel ones), and the
row-parallel term is summed by the layer's own all-reduce."""
from __future__ import annotations

import pytest
from lora_factory import ENGINE_KWARGS, greedy, make_adapter, prompt_dicts, token_ids

pytestmark = pytest.mark.slow  # starts engines (inner loop: -m 'not slow')


def test_tp2_mixed_batch_equals_tp1_and_merged(lora_models, loras, merged_outputs, tmp_path):
    from halserve import LLM, LoRARequest

    a1, a2 = loras
    choice = [a1, a2, None, a2, a1]
    batch = [lora_models.prompts[i % 4] for i in range(len(choice))]
    reference = {None: "base", a1: "merged1", a2: "merged2"}
    expected = [merged_outputs[reference[lora]][0][i % 4] for i, lora in enumerate(choice)]
    results = {}
    for tp in (1, 2):
        llm = LLM(lora_models.base, tensor_parallel_size=tp, enable_lora=True, max_loras=2, **ENGINE_KWARGS)
        try:
            results[tp] = token_ids(llm.generate(prompt_dicts(batch), greedy(), use_tqdm=False, lora_request=choice))
            if tp == 2:
                assert llm.llm_engine.core.executor.collective_rpc("list_loras") == [[1, 2], [1, 2]]
                # a bad adapter fails on every rank, and the ranks keep serving
                too_big = LoRARequest("too-big", 9, make_adapter(tmp_path / "big", lora_models.base, r=32))
                with pytest.raises(ValueError, match="'too-big'.*max_lora_rank=16"):
                    llm.generate(prompt_dicts(batch[:1]), greedy(), use_tqdm=False, lora_request=too_big)
                again = llm.generate(prompt_dicts(batch[:1]), greedy(), use_tqdm=False, lora_request=choice[0])
                assert token_ids(again) == expected[:1]
        finally:
            llm.llm_engine.shutdown()
    assert results[2] == results[1] == expected


def test_pp2_mixed_batch_equals_merged(lora_models, loras, merged_outputs):
    """Pipeline parallelism: each stage loads its own layers' part of every adapter."""
    from halserve import LLM

    a1, a2 = loras
    choice = [a1, a2, None, a2, a1]
    batch = [lora_models.prompts[i % 4] for i in range(len(choice))]
    reference = {None: "base", a1: "merged1", a2: "merged2"}
    expected = [merged_outputs[reference[lora]][0][i % 4] for i, lora in enumerate(choice)]
    llm = LLM(lora_models.base, pipeline_parallel_size=2, enable_lora=True, max_loras=2, **ENGINE_KWARGS)
    try:
        assert token_ids(llm.generate(prompt_dicts(batch), greedy(), use_tqdm=False, lora_request=choice)) == expected
        loaded = llm.llm_engine.core.executor.collective_rpc(_adapted_layers, 1)
    finally:
        llm.llm_engine.shutdown()
    assert [sorted({name.split(".")[2] for name in names}) for names in loaded] == [["0"], ["1"]]


def _adapted_layers(worker, lora_id: int) -> list[str]:
    """Run in a worker: the layer names adapter ``lora_id`` was loaded for on this rank."""
    _, weights = worker.model_runner.lora_manager._cpu[lora_id]
    return sorted(weights)
