"""The scheduler's speculative-decoding rules: how many draft tokens a decoding request carries,
the lookahead slots a workers' draft model writes, and the acceptance counters.

A proposer is an ``NgramProposer`` (the scheduler proposes) or a ``WorkerDrafts`` (the workers'
draft model proposed after the last step; ``request.spec_token_ids``); None: speculation off.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Union, cast

from halserve.spec_decode.verify import count_accepted

if TYPE_CHECKING:  # pragma: no cover
    from halserve.config import EngineConfig
    from halserve.request import Request
    from halserve.spec_decode.draft_model import WorkerDrafts
    from halserve.spec_decode.ngram import NgramProposer

Proposer = Union["NgramProposer", "WorkerDrafts"]


class DraftRule:
    def __init__(self, proposer: Proposer | None, max_model_len: int) -> None:
        self.proposer = proposer
        self.max_model_len = max_model_len
        self.num_drafts = 0  # cumulative: decode steps that carried draft tokens
        self.num_draft_tokens = 0  # cumulative: draft tokens checked by the model
        self.num_accepted_tokens = 0  # cumulative: of which accepted

    def propose(self, request: Request, token_budget: int, num_running: int) -> list[int]:
        """Draft tokens for a decoding request, at most what the budget leaves after its own token
        and what max_tokens and max_model_len leave after the bonus token. None for prefills, nor
        with ``disable_by_batch_size`` or more requests running; under a grammar, only the drafts
        the grammar allows (each draft position then gets its own mask, ``GrammarGate``)."""
        proposer = self.proposer
        if proposer is None or request.num_tokens - request.num_computed_tokens != 1:
            return []
        worker_drafts, request.spec_token_ids = request.spec_token_ids, []  # (proposed for this step only)
        if proposer.disable_by_batch_size is not None and num_running >= proposer.disable_by_batch_size:
            return []
        grammar = request.grammar
        if getattr(request.sampling_params, "pooling", None) is not None or (
                grammar is not None and (grammar.gated or grammar.waits)):
            return []  # (a grammar waiting for its start: the masks would start mid-step)
        max_drafts = min(token_budget - 1, request.max_tokens - request.num_output_tokens - 1,
                         self.max_model_len - request.num_tokens)
        if max_drafts <= 0:
            return []
        if proposer.from_worker:  # (a WorkerDrafts: the drafts came with the last step)
            drafts = worker_drafts[:max_drafts]
        else:
            drafts = cast("NgramProposer", proposer).propose(request.all_token_ids, max_drafts, key=request.request_id)
        return drafts if grammar is None else grammar.valid_prefix(drafts)

    def lookahead(self, request: Request, end: int) -> int:
        """Slots after this step's tokens (drafts included; they end at ``end``) where the workers'
        draft model writes while proposing the next drafts: k for a request that samples this step."""
        proposer = self.proposer
        if proposer is None or not proposer.from_worker:
            return 0
        if end < request.num_tokens or getattr(request.sampling_params, "pooling", None) is not None:
            return 0  # mid-prefill: nothing sampled, nothing proposed
        return max(0, min(proposer.num_speculative_tokens, self.max_model_len - end))

    def accept(self, drafts: list[int] | tuple[int, ...], sampled: list[int]) -> int:
        """How many of a step's ``drafts`` the ``sampled`` tokens confirm (counted in the stats)."""
        num_accepted = count_accepted(drafts, sampled)
        self.num_drafts += 1
        self.num_draft_tokens += len(drafts)
        self.num_accepted_tokens += num_accepted
        return num_accepted

    def on_finished(self, request: Request) -> None:
        if self.proposer is not None:
            self.proposer.forget(request.request_id)


def make_spec_proposer(config: EngineConfig) -> Proposer | None:
    """The draft proposer ``config.speculative_config`` asks for; None when it is off."""
    spec = config.speculative_config
    if spec is None:
        return None
    if spec.method == "draft_model":
        from halserve.spec_decode.draft_model import WorkerDrafts

        return WorkerDrafts(spec.num_speculative_tokens, disable_by_batch_size=spec.disable_by_batch_size)
    from halserve.spec_decode.ngram import NgramProposer

    return NgramProposer(spec.min_ngram, spec.prompt_lookup_max, spec.num_speculative_tokens,
                         disable_by_batch_size=spec.disable_by_batch_size)
