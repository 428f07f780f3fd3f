"""The sampler's tensor steps, each vectorised over the batch with per-row values.

Shapes: ``R`` requests, ``V`` vocabulary. Every function returns new logits and leaves its
input unchanged (the raw logits stay valid for logprobs).
"""
from __future__ import annotations

import torch

_NEG_INF = float("-inf")


# row_max's chunk: rows at least this long on the CPU are reduced chunk by chunk (torch's max with indices over a
# row is a scalar loop there: 64 x 49152 float32 logits took ~2.5 ms, amax ~0.1 ms)
ROW_MAX_CHUNK = 1024


def row_max(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits.max(dim=-1)`` (each row's largest value and the index of its first occurrence; a NaN counts as the
    largest, as there): on the CPU for rows of ``2 * ROW_MAX_CHUNK`` values or more, through the chunks' maxima
    (``amax``, vectorised), the first chunk holding the row's maximum, and ``max`` within that chunk; the tail past
    whole chunks is checked as a chunk of its own."""
    rows, width = logits.shape
    if logits.device.type != "cpu" or width < 2 * ROW_MAX_CHUNK or not logits.is_contiguous():
        return logits.max(dim=-1)
    whole = width // ROW_MAX_CHUNK * ROW_MAX_CHUNK
    parts = logits[:, :whole].view(rows, whole // ROW_MAX_CHUNK, ROW_MAX_CHUNK).amax(dim=-1)  # [R, C]
    if whole < width:
        parts = torch.cat([parts, logits[:, whole:].amax(dim=-1, keepdim=True)], dim=1)
    chunk = parts.argmax(dim=-1)  # [R]: the first chunk holding the maximum (a NaN's, if any)
    starts = chunk * ROW_MAX_CHUNK
    offsets = torch.arange(ROW_MAX_CHUNK, device=logits.device)
    columns = (starts.unsqueeze(1) + offsets).clamp_(max=width - 1)  # [R, chunk] (the tail's past-the-end repeat its last)
    values, within = logits.gather(1, columns).max(dim=-1)
    return values, starts + within


def apply_penalties(
    logits: torch.Tensor,  # [R, V] f32
    output_token_counts: torch.Tensor,  # [R, V] f32
    prompt_token_mask: torch.Tensor | None,  # [R, V] bool; needed with repetition_penalty
    repetition_penalty: torch.Tensor | None,  # [R]
    frequency_penalty: torch.Tensor | None,  # [R]
    presence_penalty: torch.Tensor | None,  # [R]
) -> torch.Tensor:
    """Repetition penalty over prompt + output tokens (HF/vLLM: divide positive logits,
    multiply negative ones, so the token always becomes less likely for a penalty > 1);
    frequency and presence penalties over output tokens only (OpenAI/vLLM)."""
    in_output = output_token_counts > 0  # [R, V]
    if repetition_penalty is not None:
        assert prompt_token_mask is not None
        seen = prompt_token_mask | in_output
        penalty = torch.where(seen, repetition_penalty.unsqueeze(1), 1.0)  # [R, V]
        logits = torch.where(logits > 0, logits / penalty, logits * penalty)
    if frequency_penalty is not None:
        logits = logits - frequency_penalty.unsqueeze(1) * output_token_counts
    if presence_penalty is not None:
        logits = logits - presence_penalty.unsqueeze(1) * in_output
    return logits


def mask_tokens(logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """-inf at each (rows[i], token_ids[i]): bad_words, and stop tokens of requests below min_tokens."""
    return logits.index_put((rows, token_ids), torch.tensor(_NEG_INF, device=logits.device))


def has_token(logits: torch.Tensor) -> torch.Tensor:
    """[R] bool: rows that still have a token to sample (a logit above -inf)."""
    return (logits > _NEG_INF).any(dim=-1)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the row's top probability."""
    probs = logits.softmax(dim=-1)  # [R, V]
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)  # [R, 1]
    return logits.masked_fill(probs < threshold, _NEG_INF)


def apply_top_k_top_p(
    logits: torch.Tensor,  # [R, V]
    top_k: torch.Tensor | None,  # [R] int64 in [1, V]; V = keep all
    max_top_k: int,  # largest k < V in top_k
    top_p: torch.Tensor | None,  # [R] f32 in (0, 1]; 1 = keep all
) -> torch.Tensor:
    """Keep each row's top_k tokens, then the smallest prefix (by probability) whose mass
    reaches top_p. Ties at the top-k threshold are all kept, as in vLLM."""
    if top_p is None:
        if top_k is None:
            return logits
        # Only top-k: a partial topk() to the largest k in use is cheaper than a full sort.
        top_values = logits.topk(max_top_k, dim=-1).values  # [R, max_top_k], descending
        kth = top_values.gather(1, (top_k.clamp(max=max_top_k) - 1).unsqueeze(1))  # [R, 1]
        kth = kth.masked_fill((top_k >= logits.shape[-1]).unsqueeze(1), _NEG_INF)  # rows without top-k
        return logits.masked_fill(logits < kth, _NEG_INF)

    sorted_logits, sorted_idx = logits.sort(dim=-1)  # ascending: [R, V]
    if top_k is not None:
        kth = sorted_logits.gather(1, (logits.shape[-1] - top_k).unsqueeze(1))  # [R, 1]
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, _NEG_INF)
    cum_probs = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # [R, V], ascending mass
    # Drop the low tail whose mass stays within 1 - top_p; the best token always survives.
    drop = cum_probs <= (1.0 - top_p).unsqueeze(1)
    drop[:, -1] = False
    sorted_logits = sorted_logits.masked_fill(drop, _NEG_INF)
    return torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)


def gumbel_sample(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """[R] int64: one token per row drawn from ``probs`` [R, V].

    argmax(p_i / E_i) with E_i ~ Exponential(1) picks token i with probability p_i (the
    exponential form of the Gumbel-max trick) and needs no cumulative sums. A seeded row
    draws its noise from its own generator, so it does not depend on the other rows.
    """
    noise = torch.empty_like(probs).exponential_()  # [R, V]
    for row, gen in generators.items():
        if gen.device == probs.device:
            noise[row].exponential_(generator=gen)
        else:  # the device has no generators of its own: drew on the host
            noise[row].copy_(torch.empty(probs.shape[1], dtype=probs.dtype).exponential_(generator=gen))
    # E = 0 would turn a zero-probability token into 0/0 = NaN, which argmax prefers.
    noise.clamp_min_(torch.finfo(noise.dtype).tiny)
    return (probs / noise).argmax(dim=-1)


def add_logit_bias(
    logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor, bias: torch.Tensor
) -> torch.Tensor:
    """``bias[i]`` added at each (rows[i], token_ids[i]): the requests' logit_bias."""
    return logits.index_put((rows, token_ids), bias, accumulate=True)
