"""The model runner tells the layers whether a step is a decode step (``ForwardContext.decode_only``: every
request one query token), which the cpu GGUF kernel reads to keep decode rows at one int8 level."""
from __future__ import annotations

import halserve.forward_context as forward_context


def test_decode_steps_are_marked_and_prefill_steps_are_not(tmp_path, monkeypatch):
    from model_factory import make_checkpoint

    from halserve import LLM, SamplingParams

    seen: list[tuple[bool, int]] = []  # (decode_only, the step's tokens)
    original = forward_context.set_forward_context

    def recording(attn_metadata, kv_connector=None, decode_only=False):
        if attn_metadata is not None:
            seen.append((decode_only, attn_metadata.num_actual_tokens))
        return original(attn_metadata, kv_connector, decode_only=decode_only)

    monkeypatch.setattr(forward_context, "set_forward_context", recording)
    path = make_checkpoint(str(tmp_path), "llama", vocab_size=512, num_layers=1)
    llm = LLM(path, platform="cpu", dtype="float32", max_model_len=128)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        llm.generate([{"prompt_token_ids": [5, 6, 7, 8, 9]}, {"prompt_token_ids": [10, 11, 12]}], params,
                     use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    assert seen[0] == (False, 8)  # the two prompts' prefill
    assert seen[1:] == [(True, 2)] * 3  # then one token each, three times
    assert not forward_context.in_decode_step()  # (outside a step)
