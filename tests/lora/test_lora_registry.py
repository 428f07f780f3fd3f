"""Which adapters the workers hold is the engine core's decision (``halserve.lora.registry``):
adapters load when a request first needs them, never during a step, so adapter files that
change or vanish afterwards fail at most a new request (clearly), never the engine."""
from __future__ import annotations

import shutil

import pytest
from lora_factory import ENGINE_KWARGS, greedy, prompt_dicts, token_ids


@pytest.fixture
def copies(tmp_path, lora_models):
    """Copies of both adapters that a test may delete."""
    from halserve import LoRARequest

    paths = [shutil.copytree(getattr(lora_models, name), tmp_path / name) for name in ("a1", "a2")]
    return [LoRARequest(f"c{i + 1}", 10 + i, str(path)) for i, path in enumerate(paths)]


def _engine(lora_models, **kwargs):
    from halserve import LLM

    return LLM(lora_models.base, enable_lora=True, max_lora_rank=16, **ENGINE_KWARGS, **kwargs)


def test_adapters_deleted_after_loading_still_serve_their_requests(lora_models, copies, merged_outputs):
    # max_loras=1 with both adapters in the batch: each is moved to and from the device across
    # steps; with its files gone meanwhile, nothing is read from disk again
    llm = _engine(lora_models, max_loras=1, max_cpu_loras=1)
    try:
        engine = llm.llm_engine
        choice = [copies[0], copies[1], copies[0], copies[1]]
        for i, lora in enumerate(choice):
            engine.add_request(f"r{i}", prompt_dicts(lora_models.prompts)[i], greedy(), lora_request=lora)
        for lora in copies:
            shutil.rmtree(lora.lora_path)
        outputs = {}
        while engine.has_unfinished_requests():
            outputs.update({o.request_id: o for o in engine.step() if o.finished})
        expected = [merged_outputs["merged1" if lora is copies[0] else "merged2"][0][i] for i, lora in
                    enumerate(choice)]
        assert token_ids([outputs[f"r{i}"] for i in range(len(choice))]) == expected
        # once their requests ended, the cap (max_cpu_loras=1) unloads one: a new request for it
        # must read it again, and its files are gone: a clear error for that request alone
        with pytest.raises(ValueError, match="c1|c2"):
            for lora in copies:
                llm.generate(prompt_dicts(lora_models.prompts[:1]), greedy(), use_tqdm=False, lora_request=lora)
        base = llm.generate(prompt_dicts(lora_models.prompts), greedy(), use_tqdm=False)
        assert token_ids(base) == merged_outputs["base"][0]
    finally:
        llm.llm_engine.shutdown()


def test_removing_an_adapter_in_use_lets_its_requests_finish(lora_models, copies, merged_outputs):
    llm = _engine(lora_models, max_loras=2)
    try:
        engine = llm.llm_engine
        prompts = prompt_dicts(lora_models.prompts)
        engine.add_request("a", prompts[0], greedy(), lora_request=copies[0])
        engine.step()
        assert engine.remove_lora(copies[0].lora_int_id)
        assert copies[0].lora_int_id not in engine.list_loras()
        outputs = {}
        while engine.has_unfinished_requests():
            outputs.update({o.request_id: o for o in engine.step() if o.finished})
        assert token_ids([outputs["a"]]) == [merged_outputs["merged1"][0][0]]
        assert not engine.remove_lora(copies[0].lora_int_id)  # gone already
        # asked for again, it is loaded again (its files are still there)
        again = llm.generate(prompts[:1], greedy(), use_tqdm=False, lora_request=copies[0])
        assert token_ids(again) == [merged_outputs["merged1"][0][0]]
    finally:
        llm.llm_engine.shutdown()


def test_max_cpu_loras_unloads_the_least_recently_used_idle_adapter(lora_models, copies):
    llm = _engine(lora_models, max_loras=1, max_cpu_loras=1)
    try:
        engine = llm.llm_engine
        prompts = prompt_dicts(lora_models.prompts[:1])
        llm.generate(prompts, greedy(), use_tqdm=False, lora_request=copies[0])
        assert engine.list_loras() == {copies[0].lora_int_id}
        llm.generate(prompts, greedy(), use_tqdm=False, lora_request=copies[1])
        assert engine.list_loras() == {copies[1].lora_int_id}  # c1 was idle: unloaded
        workers = engine.core.executor.collective_rpc("list_loras")
        assert all(ids == [copies[1].lora_int_id] for ids in workers), workers
    finally:
        llm.llm_engine.shutdown()


def test_more_adapters_in_flight_than_max_cpu_loras(lora_models, copies, merged_outputs):
    # every loaded adapter is in use when the next one is added: that one must stay loaded for
    # its request (it used to be evicted at once, and the step died on an unloaded adapter)
    llm = _engine(lora_models, max_loras=1, max_cpu_loras=1)
    try:
        choice = [copies[0], copies[1], None, copies[1], copies[0]]
        outs = llm.generate(prompt_dicts(lora_models.prompts[:1] * len(choice)), greedy(), use_tqdm=False,
                            lora_request=choice)
        reference = {None: "base", 10: "merged1", 11: "merged2"}
        expected = [merged_outputs[reference[lora.lora_int_id if lora else None]][0][0] for lora in choice]
        assert token_ids(outs) == expected
        assert len(llm.llm_engine.list_loras()) == 1  # back within the cap once they finished
    finally:
        llm.llm_engine.shutdown()


def test_a_held_adapter_outlives_its_removal_until_let_go(lora_models, copies, merged_outputs):
    # a beam search holds its adapter between steps: an unload meanwhile takes effect at its end
    llm = _engine(lora_models, max_loras=1)
    try:
        engine, core = llm.llm_engine, llm.llm_engine.core
        core.hold_lora(copies[0], True)
        assert core.remove_lora(copies[0].lora_int_id)
        assert copies[0].lora_int_id not in engine.list_loras()  # gone for new callers
        shutil.rmtree(copies[0].lora_path)  # still served from memory
        again = llm.generate(prompt_dicts(lora_models.prompts[:1]), greedy(), use_tqdm=False,
                             lora_request=copies[0])
        assert token_ids(again) == [merged_outputs["merged1"][0][0]]
        core.hold_lora(copies[0], False)
        assert core.executor.collective_rpc("list_loras") == [[]]  # dropped at the end
        with pytest.raises(ValueError, match="c1"):
            llm.generate(prompt_dicts(lora_models.prompts[:1]), greedy(), use_tqdm=False, lora_request=copies[0])
    finally:
        llm.llm_engine.shutdown()
