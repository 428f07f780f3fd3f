"""The steps of ``AsyncLLM.beam_search`` as ordinary AsyncLLM requests.

``AsyncLLM.beam_search`` tokenizes the prompts into ``BeamSearch``es (``halserve.beam_search``)
and hands them to ``run_beam_searches``, which runs them in lockstep: each step submits one
one-token request per live beam of every prompt, all at once, through ``AsyncLLM.add_request``
like any other request (so aborts, metrics and a dead engine behave as for any other).
"""
from __future__ import annotations

import contextlib
import itertools
from typing import TYPE_CHECKING, Any

from halserve.engine.request_stream import EngineDeadError

if TYPE_CHECKING:  # pragma: no cover
    from collections.abc import Sequence

    from halserve.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
    from halserve.engine.async_llm import AsyncLLM
    from halserve.lora.request import LoRARequest

__all__ = ["run_beam_searches"]


async def run_beam_searches(
    llm: AsyncLLM,
    searches: Sequence[BeamSearch],
    params: BeamSearchParams,
    request_id: str,
    lora_request: LoRARequest | None,
) -> list[BeamSearchOutput]:
    """Run ``searches`` to the end; called by ``AsyncLLM.beam_search``. The step requests are
    named ``{request_id}-{k}`` and use the adapter ``lora_request``, if given (held loaded until
    the end). A prompt the engine refuses raises ``ValueError`` at the first step; cancelling the
    caller aborts the step's requests."""
    from halserve.beam_search import first_token_logprobs, run_beam_search_async, step_sampling_params

    step_params = step_sampling_params(params)
    step_ids = itertools.count()

    async def run_one(tokens: list[int]) -> Any:
        stream = await llm.add_request({"prompt_token_ids": tokens}, step_params, f"{request_id}-{next(step_ids)}",
                                       lora_request=lora_request)
        try:
            final = None
            async for final in stream:  # noqa: B007
                pass
        finally:
            stream.close()
        assert final is not None
        return first_token_logprobs(final)

    decode = llm.tokenizer.decode if llm.tokenizer is not None else None
    if lora_request is None:
        return await run_beam_search_async(searches, run_one, decode)
    # the adapter stays loaded between the steps' requests (an unload meanwhile waits for the end)
    await llm.call_core("hold_lora", lora_request, True)
    try:
        return await run_beam_search_async(searches, run_one, decode)
    finally:
        with contextlib.suppress(EngineDeadError):  # (a dead engine holds nothing)
            await llm.call_core("hold_lora", lora_request, False)
