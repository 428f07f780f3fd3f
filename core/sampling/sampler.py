"""The on-device sampler: one token per request from the model's last-position logits."""
from __future__ import annotations

import torch

from halserve.sampling.logprobs import gather_logprobs
from halserve.sampling.metadata import SamplingMetadata
from halserve.sampling.ops import (
    add_logit_bias,
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    gumbel_sample,
    mask_tokens,
)
from halserve.scheduler_output import SampleLogprobs


class Sampler:
    """Called by the model runner once per step, on the logits' device.

    Order (as vLLM): logprobs from the raw logits; allowed_token_ids; logit_bias;
    penalties; min_tokens masking;
    then greedy rows take the argmax, random rows go through temperature, min_p, top_k,
    top_p and an exponential-race (Gumbel) draw.
    """

    def __call__(
        self, logits: torch.Tensor, meta: SamplingMetadata
    ) -> tuple[torch.Tensor, list[SampleLogprobs | None]]:
        """logits [R, V] -> (sampled token ids [R] int64 on the logits' device, per-row
        ``SampleLogprobs`` for rows whose params asked for logprobs, else None)."""
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
        if meta.min_tokens_rows is not None:
            assert meta.min_tokens_token_ids is not None
            logits = mask_tokens(logits, meta.min_tokens_rows, meta.min_tokens_token_ids)

        if meta.all_greedy:
            sampled = logits.argmax(dim=-1)
        else:
            sampled = self._sample_random(logits, meta)

        if raw_logprobs is None:
            return sampled, [None] * meta.num_reqs
        assert meta.max_num_logprobs is not None
        return sampled, gather_logprobs(raw_logprobs, sampled, meta.num_logprobs, meta.max_num_logprobs)

    @staticmethod
    def _sample_random(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        greedy = None if meta.all_random else logits.argmax(dim=-1)  # [R]
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
