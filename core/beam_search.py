"""Beam search above the engine, as vLLM (V1) runs it: no beam-aware kernel, only ordinary
one-token requests, whose shared prefixes the prefix cache makes cheap.

    each step, per prompt:
      every live beam -> one request: its tokens as the prompt, max_tokens=1,
                         logprobs=2*beam_width -> the most likely next tokens
      candidate = beam + one of them; cum_logprob = the beam's + that token's logprob
      an EOS candidate (unless ignore_eos) is finished: completed, finish_reason "stop"
      the others, highest cum_logprob first -> the next step's beam_width live beams
    after max_tokens steps (fewer where max_model_len leaves less room), or once no beam lives:
      completed + live ("length"), ranked by get_beam_search_score -> the best beam_width

``BeamSearch`` holds one prompt's search and knows nothing of engines: it says which token
sequences to extend and digests each one's top logprobs. ``run_beam_search`` drives searches
with a function that runs a batch of one-token requests (``LLM.beam_search``);
``run_beam_search_async`` with a coroutine per request, a step's requests all in flight at
once (``AsyncLLM.beam_search``, the server's ``use_beam_search``).
"""
from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from halserve.sampling_params import MAX_LOGPROBS

if TYPE_CHECKING:  # pragma: no cover
    from halserve.outputs import Logprob, RequestOutput
    from halserve.sampling_params import SamplingParams

__all__ = [
    "MAX_BEAM_WIDTH",
    "BeamSearch",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "first_token_logprobs",
    "get_beam_search_score",
    "run_beam_search",
    "run_beam_search_async",
    "step_sampling_params",
]

# Each step asks for 2 * beam_width logprobs per beam (as vLLM and transformers do: enough
# that beam_width candidates survive even where EOS is among the best), at most MAX_LOGPROBS.
MAX_BEAM_WIDTH = MAX_LOGPROBS // 2

TopLogprobs = dict[int, "Logprob"]  # one step's most likely next tokens, by token id


@dataclass(slots=True, kw_only=True)
class BeamSearchParams:
    """vLLM's beam search parameters. Invalid values raise ``ValueError``."""

    beam_width: int
    """Beams kept at each step, and sequences returned per prompt: 1..MAX_BEAM_WIDTH (10)."""
    max_tokens: int
    """Most tokens to generate, >= 1 (a beam also stops where the context, max_model_len, ends)."""
    ignore_eos: bool = False
    """Extend beams past EOS instead of finishing them."""
    temperature: float = 0.0
    """Must be 0: beams are ranked by the model's own logprobs, deterministically."""
    length_penalty: float = 1.0
    """The final ranking's score is cum_logprob / length ** length_penalty (see
    ``get_beam_search_score``): 0 ranks by cum_logprob alone, larger values favour longer beams."""
    include_stop_str_in_output: bool = False
    """Keep the EOS token that finished a beam in its tokens."""

    def __post_init__(self) -> None:
        bw = self.beam_width
        if type(bw) is not int or not 1 <= bw <= MAX_BEAM_WIDTH:
            raise ValueError(
                f"beam_width must be an integer in [1, {MAX_BEAM_WIDTH}], got {bw!r} (each step asks the model "
                f"for the 2 * beam_width most likely next tokens, and at most {MAX_LOGPROBS} logprobs are returned)"
            )
        mt = self.max_tokens
        if type(mt) is not int or mt < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {mt!r}")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or t != 0:
            raise ValueError(f"temperature must be 0 for beam search (beams are ranked by the model's logprobs, "
                             f"nothing is sampled), got {t!r}")
        lp = self.length_penalty
        if isinstance(lp, bool) or not isinstance(lp, (int, float)) or not math.isfinite(lp):
            raise ValueError(f"length_penalty must be a finite number (1.0: vLLM's default), got {lp!r}")


@dataclass(slots=True)
class BeamSearchSequence:
    """One beam (vLLM's fields)."""

    tokens: list[int]  # the prompt's tokens, then the generated ones (a finishing EOS only with include_stop_str)
    logprobs: list[TopLogprobs]  # per generated token: the top logprobs of the step that chose it
    cum_logprob: float = 0.0  # sum of the generated tokens' logprobs (a finishing EOS's included)
    text: str | None = None  # returned sequences: ``tokens`` decoded, the prompt included (as vLLM's LLM)
    finish_reason: str | None = None  # returned sequences: "stop" (EOS) or "length"
    stop_reason: int | None = None  # the EOS id that finished it (as vLLM's beam search); None otherwise


@dataclass
class BeamSearchOutput:
    """One prompt's result (vLLM's shape, plus the prompt's token ids)."""

    sequences: list[BeamSearchSequence]  # best first by get_beam_search_score, at most beam_width
    prompt_token_ids: list[int] = field(default_factory=list)  # each sequence's generated tokens follow these


def get_beam_search_score(tokens: Sequence[int], cumulative_logprob: float, eos_token_ids: Collection[int],
                          length_penalty: float = 1.0) -> float:
    """vLLM's (after transformers'): ``cumulative_logprob / length ** length_penalty``, the
    length counting the prompt's tokens and the generated ones but not a final EOS, with
    ignore_eos too (as vLLM's ranking). vLLM's takes the tokenizer's one EOS id; halserve's
    engine stops on every EOS id of the model, so this takes them all."""
    length = len(tokens)
    if tokens and tokens[-1] in eos_token_ids:
        length -= 1
    length = max(length, 1)  # (a prompt of one EOS token, finished at once)
    try:
        return cumulative_logprob / (length ** length_penalty)
    except (OverflowError, ZeroDivisionError):  # length ** length_penalty past float's range: its limit
        if cumulative_logprob == 0.0:
            return 0.0
        return cumulative_logprob * (0.0 if length_penalty > 0 else math.inf)


def step_sampling_params(params: BeamSearchParams) -> SamplingParams:
    """The one-token request each beam sends each step: greedy, the 2 * beam_width top logprobs.
    Everything that could change the chosen token is set, so model defaults cannot apply."""
    from halserve.sampling_params import SamplingParams

    return SamplingParams(max_tokens=1, temperature=0.0, logprobs=2 * params.beam_width, ignore_eos=True,
                          detokenize=False, top_p=1.0, top_k=0, min_p=0.0, presence_penalty=0.0,
                          frequency_penalty=0.0, repetition_penalty=1.0)


def first_token_logprobs(output: RequestOutput) -> TopLogprobs | None:
    """A finished step request's top logprobs (None when it generated no token)."""
    logprobs = output.outputs[0].logprobs
    return logprobs[0] if logprobs else None


class BeamSearch:
    """One prompt's search. Each step: ``pending()`` gives the live beams' token sequences; the
    driver runs a one-token request (``step_sampling_params``) for each and hands the results
    to ``update`` in the same order; once ``done``, ``result()`` ranks the beams."""

    def __init__(self, prompt_token_ids: Sequence[int], params: BeamSearchParams, eos_token_ids: Collection[int],
                 max_model_len: int | None = None) -> None:
        self.params = params
        self.prompt_token_ids = list(prompt_token_ids)
        self.eos_token_ids = frozenset(eos_token_ids)
        # A beam cannot outgrow the context. At least one step runs: where the prompt alone
        # fills it, the engine refuses that step's request and says why.
        room = None if max_model_len is None else max_model_len - len(self.prompt_token_ids)
        self.num_steps_left = params.max_tokens if room is None else max(1, min(params.max_tokens, room))
        self.beams = [BeamSearchSequence(tokens=list(self.prompt_token_ids), logprobs=[])]
        self.completed: list[BeamSearchSequence] = []

    @property
    def done(self) -> bool:
        return self.num_steps_left == 0 or not self.beams

    def pending(self) -> list[list[int]]:
        """The token sequences to extend by one token this step (none once done)."""
        return [] if self.done else [beam.tokens for beam in self.beams]

    def update(self, results: Sequence[TopLogprobs | None]) -> None:
        """Digest one step: ``results[i]`` is the top logprobs after ``pending()[i]``, or None
        where that request returned none (its beam is dropped, as in vLLM)."""
        assert not self.done and len(results) == len(self.beams), (len(results), len(self.beams))
        params = self.params
        candidates: list[tuple[float, BeamSearchSequence, int, TopLogprobs]] = []
        for beam, top in zip(self.beams, results):
            if not top:
                continue
            for token_id, logprob in top.items():
                cum_logprob = beam.cum_logprob + logprob.logprob
                if token_id in self.eos_token_ids and not params.ignore_eos:
                    tokens = beam.tokens + [token_id] if params.include_stop_str_in_output else list(beam.tokens)
                    self.completed.append(BeamSearchSequence(
                        tokens=tokens, logprobs=beam.logprobs + [top], cum_logprob=cum_logprob,
                        finish_reason="stop", stop_reason=token_id,
                    ))
                else:
                    candidates.append((cum_logprob, beam, token_id, top))
        # Ranked by cum_logprob, as vLLM's search ranks a step's candidates (all of one length).
        candidates.sort(key=lambda c: c[0], reverse=True)
        self.beams = [
            BeamSearchSequence(tokens=beam.tokens + [token_id], logprobs=beam.logprobs + [top], cum_logprob=cum)
            for cum, beam, token_id, top in candidates[: params.beam_width]
        ]
        self.num_steps_left -= 1

    def result(self, decode: Callable[[list[int]], str] | None = None) -> BeamSearchOutput:
        """The best ``beam_width`` of the finished and the live beams (the live ones finish with
        "length"), best first; ``decode`` fills each one's ``text``."""
        params = self.params
        for beam in self.beams:
            beam.finish_reason = "length"
        ranked = sorted(
            self.completed + self.beams, reverse=True,
            key=lambda s: get_beam_search_score(s.tokens, s.cum_logprob, self.eos_token_ids, params.length_penalty),
        )[: params.beam_width]
        if decode is not None:
            for seq in ranked:
                seq.text = decode(seq.tokens)
        return BeamSearchOutput(sequences=ranked, prompt_token_ids=self.prompt_token_ids)


def run_beam_search(
    searches: Sequence[BeamSearch],
    run_batch: Callable[[list[list[int]]], Sequence[TopLogprobs | None]],
    decode: Callable[[list[int]], str] | None = None,
) -> list[BeamSearchOutput]:
    """Drive ``searches`` in lockstep: each step, every live beam of every search goes into one
    ``run_batch`` call, which returns each sequence's next-token top logprobs in order."""
    while True:
        live, batch = _next_step(searches)
        if not live:
            return [search.result(decode) for search in searches]
        _apply(live, run_batch(batch))


async def run_beam_search_async(
    searches: Sequence[BeamSearch],
    run_one: Callable[[list[int]], Awaitable[TopLogprobs | None]],
    decode: Callable[[list[int]], str] | None = None,
) -> list[BeamSearchOutput]:
    """``run_beam_search`` with a coroutine per one-token request: a step's requests are all in
    flight at once. If one fails, or the caller is cancelled, the others are cancelled (which
    must abort their requests) before the error propagates."""
    while True:
        live, batch = _next_step(searches)
        if not live:
            return [search.result(decode) for search in searches]
        _apply(live, await _gather_or_cancel([run_one(tokens) for tokens in batch]))


def _next_step(searches: Sequence[BeamSearch]) -> tuple[list[BeamSearch], list[list[int]]]:
    live = [search for search in searches if not search.done]
    return live, [tokens for search in live for tokens in search.pending()]


def _apply(live: list[BeamSearch], results: Sequence[TopLogprobs | None]) -> None:
    start = 0
    for search in live:
        end = start + len(search.beams)
        search.update(results[start:end])
        start = end
    assert start == len(results), (start, len(results))


async def _gather_or_cancel(coros: list[Awaitable[TopLogprobs | None]]) -> list[TopLogprobs | None]:
    tasks = [asyncio.ensure_future(coro) for coro in coros]
    try:
        return await asyncio.gather(*tasks)
    finally:
        unfinished = [task for task in tasks if not task.done()]
        for task in unfinished:
            task.cancel()
        if unfinished:
            await asyncio.gather(*unfinished, return_exceptions=True)
