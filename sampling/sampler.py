"""The on-device sampler: one token per request from the model's last-position logits."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from halserve.sampling.logprobs import gather_logprobs
from halserve.sampling.metadata import SamplingMetadata
from halserve.sampling.ops import (
    add_logit_bias,
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    gumbel_sample,
    has_token,
    mask_tokens,
    row_max,
)
from halserve.scheduler_output import SampleLogprobs


@dataclass(slots=True)
class SamplerOutput:
    """One step's draw for a batch of R rows."""

    sampled_token_ids: torch.Tensor  # [R] int64 on the logits' device; arbitrary where has_token is False
    logprobs: list[SampleLogprobs | None]  # per row, when its params asked for logprobs
    # [R] bool: False where the hard constraints (allowed_token_ids, bad_words, min_tokens, the
    # caller's grammar mask) leave no token at all; such a row's token must not be used
    has_token: torch.Tensor
    # [R] bool: True where stop tokens were all the other constraints left, so min_tokens let
    # one be sampled (its request is to end there); None when no row is under min_tokens
    min_tokens_waived: torch.Tensor | None


class Sampler:
    """Called by the model runner once per step, on the logits' device.

    Order (as vLLM): logprobs from the raw logits; allowed_token_ids; bad_words; logit_bias;
    penalties; min_tokens masking;
    then greedy rows take the argmax, random rows go through temperature, min_p, top_k,
    top_p and an exponential-race (Gumbel) draw.

    Hard constraints (-inf logits: allowed_token_ids, bad_words, min_tokens, a grammar) can leave a row
    nothing: min_tokens gives way when only stop tokens are left (a complete structured
    output ends rather than break its grammar); a row left with no token at all is reported
    in ``SamplerOutput.has_token`` (logit_bias is soft: -100 leaves a token sampleable).
    """

    def __call__(
        self, logits: torch.Tensor, meta: SamplingMetadata
    ) -> tuple[torch.Tensor, list[SampleLogprobs | None]]:
        """logits [R, V] -> (sampled token ids [R] int64 on the logits' device, per-row
        ``SampleLogprobs`` for rows whose params asked for logprobs, else None): ``sample``
        without its constraint reports."""
        out = self.sample(logits, meta)
        return out.sampled_token_ids, out.logprobs

    def sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """logits [R, V] (rows a grammar forbids already -inf) -> one token per row."""
        if logits.dim() != 2 or logits.shape[0] != meta.num_reqs or logits.shape[1] != meta.vocab_size:
            raise ValueError(
                f"logits of shape {tuple(logits.shape)} do not match the sampling metadata "
                f"({meta.num_reqs} requests, vocab_size {meta.vocab_size})"
            )
        logits = logits.float()  # a no-op for float32 logits

        # Users compare logprobs with the model's own distribution: take them before any
        # penalty, temperature or filter changes it.
        raw_logprobs = logits.log_softmax(dim=-1) if meta.max_num_logprobs is not None else None

        if meta.disallowed is not None:
            logits = logits.masked_fill(meta.disallowed, float("-inf"))
        if meta.banned_rows is not None:
            assert meta.banned_token_ids is not None
            logits = mask_tokens(logits, meta.banned_rows, meta.banned_token_ids)
        if meta.bias_rows is not None:
            assert meta.bias_token_ids is not None and meta.bias_values is not None
            logits = add_logit_bias(logits, meta.bias_rows, meta.bias_token_ids, meta.bias_values)
        if meta.has_penalties:
            assert meta.output_token_counts is not None
            logits = apply_penalties(
                logits,
                meta.output_token_counts,
                meta.prompt_token_mask,
                meta.repetition_penalty,
                meta.frequency_penalty,
                meta.presence_penalty,
            )
        kept: torch.Tensor | None = None  # [R] bool: rows min_tokens masking leaves a token
        if meta.min_tokens_rows is not None:
            assert meta.min_tokens_token_ids is not None
            masked = mask_tokens(logits, meta.min_tokens_rows, meta.min_tokens_token_ids)
            kept = has_token(masked)
            logits = torch.where(kept.unsqueeze(1), masked, logits)

        # A row with a token left draws one with a finite logit (the filters keep each row's
        # best token); a row with none draws an arbitrary -inf one.
        if meta.all_greedy:  # one op: max returns argmax's index (the first maximum) with its logit
            chosen, sampled = row_max(logits)  # [R], [R]
        else:
            sampled = self._sample_random(logits, meta)
            chosen = logits.gather(1, sampled.unsqueeze(1)).squeeze(1)  # [R], O(R): no [R, V] scan
        sampled_ok = chosen > float("-inf")
        waived = None if kept is None else sampled_ok & ~kept

        if raw_logprobs is None:
            logprobs: list[SampleLogprobs | None] = [None] * meta.num_reqs
        else:
            assert meta.max_num_logprobs is not None
            logprobs = gather_logprobs(raw_logprobs, sampled, meta.num_logprobs, meta.max_num_logprobs)
        return SamplerOutput(sampled, logprobs, has_token=sampled_ok, min_tokens_waived=waived)

    @staticmethod
    def _sample_random(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        greedy = None if meta.all_random else row_max(logits)[1]  # [R]
        assert meta.temperature is not None
        logits = logits / meta.temperature.unsqueeze(1)  # [R, V]
        if meta.min_p is not None:
            logits = apply_min_p(logits, meta.min_p)
        logits = apply_top_k_top_p(logits, meta.top_k, meta.max_top_k, meta.top_p)
        sampled = gumbel_sample(logits.softmax(dim=-1), meta.generators)
        if greedy is None:
            return sampled
        assert meta.is_greedy is not None
        return torch.where(meta.is_greedy, greedy, sampled)
