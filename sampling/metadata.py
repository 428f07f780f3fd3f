"""Per-step sampling state of a batch: the requests' parameters as tensors on the logits' device.

Built once per step by the model runner (``SamplingMetadata.build``); read by ``Sampler``.
Every optional tensor is ``None`` when no request in the batch needs it, so a batch of
greedy requests without penalties, min_tokens or logprobs builds almost nothing.
"""
from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import torch

from halserve.sampling_params import SAMPLING_EPS, SamplingParams

_U64 = (1 << 64) - 1
# Seeded streams: seed and step are mixed into one generator seed (see ``seed_for_step``).
_SEED_STRIDE = 1_000_003


def seed_for_step(seed: int, num_output_tokens: int) -> int:
    """The generator seed for a seeded request's next token.

    Depends only on the request's seed and how many tokens it has generated, so its tokens
    do not depend on what else is batched, nor on preemption (a recomputed request resumes
    with the same output count and therefore the same noise)."""
    return (seed * _SEED_STRIDE + num_output_tokens) & _U64


def _make_generator(seed: int, device: torch.device) -> torch.Generator:
    try:
        gen = torch.Generator(device=device)
    except RuntimeError:  # a device without its own generators: draw on the host
        gen = torch.Generator()
    gen.manual_seed(seed)
    return gen


@dataclass(slots=True)
class SamplingMetadata:
    num_reqs: int
    vocab_size: int
    all_greedy: bool  # every row takes the argmax: no temperature/filters/noise at all
    all_random: bool  # no row is greedy (no argmax/where needed)
    is_greedy: torch.Tensor | None = None  # [R] bool; None when all_greedy or all_random
    temperature: torch.Tensor | None = None  # [R] f32, 1.0 on greedy rows; None when all_greedy
    min_p: torch.Tensor | None = None  # [R] f32, 0 = off; None when no random row uses it
    top_k: torch.Tensor | None = None  # [R] int64 in [1, V], V = off; None when no row uses it
    max_top_k: int = 0  # largest top_k in use (< V), for a topk() instead of a full sort
    top_p: torch.Tensor | None = None  # [R] f32, 1 = off; None when no row uses it
    generators: dict[int, torch.Generator] = field(default_factory=dict)  # row -> seeded row's generator
    # Penalties (None when no row has that penalty).
    presence_penalty: torch.Tensor | None = None  # [R] f32
    frequency_penalty: torch.Tensor | None = None  # [R] f32
    repetition_penalty: torch.Tensor | None = None  # [R] f32
    output_token_counts: torch.Tensor | None = None  # [R, V] f32: occurrences of each token in the output
    prompt_token_mask: torch.Tensor | None = None  # [R, V] bool: token occurs in the prompt
    # min_tokens: (row, token) pairs whose logit is -inf this step (stop tokens of short outputs).
    min_tokens_rows: torch.Tensor | None = None  # [M] int64
    min_tokens_token_ids: torch.Tensor | None = None  # [M] int64
    # logit_bias: bias_values[i] is added at (bias_rows[i], bias_token_ids[i]).
    bias_rows: torch.Tensor | None = None  # [B] int64
    bias_token_ids: torch.Tensor | None = None  # [B] int64
    bias_values: torch.Tensor | None = None  # [B] f32
    # allowed_token_ids: True where a row may not sample the token (all False in rows without a list).
    disallowed: torch.Tensor | None = None  # [R, V] bool
    # bad_words: (row, token) pairs whose logit is -inf this step (tokens that would complete a banned
    # sequence); None when no row's output ends in a banned prefix.
    banned_rows: torch.Tensor | None = None  # [W] int64
    banned_token_ids: torch.Tensor | None = None  # [W] int64
    # Logprobs: per row the number of top alternatives asked (None = no logprobs).
    num_logprobs: list[int | None] = field(default_factory=list)
    max_num_logprobs: int | None = None  # None when no row asks

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty is not None
            or self.frequency_penalty is not None
            or self.repetition_penalty is not None
        )

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]],
        vocab_size: int,
        device: torch.device | str,
        eos_token_ids: Collection[int] | Sequence[Collection[int]] = (),
    ) -> SamplingMetadata:
        """Build the metadata of one step's batch.

        Row ``i`` of every argument describes the request in row ``i`` of the logits:
        ``params[i]`` its sampling params; ``prompt_token_ids[i]`` its prompt (read only
        when it uses repetition_penalty); ``output_token_ids[i]`` the tokens it generated
        before this step (penalties, min_tokens, bad_words and the seeded noise stream).
        ``eos_token_ids``: the EOS ids masked (besides stop_token_ids) while a request has
        fewer than min_tokens outputs, unless it has ignore_eos; either one collection of
        ids shared by every row (the model's, e.g. ``{2}``) or one collection per row.
        ``vocab_size`` is the logits' last dimension; ``device`` the logits' device.
        """
        num_reqs = len(params)
        if len(prompt_token_ids) != num_reqs or len(output_token_ids) != num_reqs:
            raise ValueError(
                f"one prompt and one output list per request expected: got {num_reqs} params, "
                f"{len(prompt_token_ids)} prompt lists, {len(output_token_ids)} output lists"
            )
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        device = torch.device(device)

        greedy: list[bool] = []
        num_logprobs: list[int | None] = []
        uses_filter = uses_penalty = uses_min_tokens = uses_token_lists = uses_bad_words = False
        for p, out in zip(params, output_token_ids):
            is_greedy = p.temperature < SAMPLING_EPS
            greedy.append(is_greedy)
            num_logprobs.append(p.logprobs)
            if not is_greedy and (p.top_k != 0 or p.top_p < 1.0 or p.min_p > 0.0):
                uses_filter = True
            if _uses_penalty(p):
                uses_penalty = True
            if _masks_min_tokens(p, len(out)):
                uses_min_tokens = True
            if _uses_token_lists(p):
                uses_token_lists = True
            if p.bad_words_token_ids:
                uses_bad_words = True

        all_greedy = all(greedy)
        meta = cls(num_reqs=num_reqs, vocab_size=vocab_size, all_greedy=all_greedy, all_random=not any(greedy))
        asked = [k for k in num_logprobs if k is not None]
        if asked:
            meta.num_logprobs = num_logprobs
            meta.max_num_logprobs = max(asked)
        if not all_greedy:
            meta._build_random(params, greedy, output_token_ids, uses_filter, device)
        if uses_penalty:
            meta._build_penalties(params, prompt_token_ids, output_token_ids, device)
        if uses_min_tokens:
            meta._build_min_tokens(params, output_token_ids, eos_token_ids, device)
        if uses_token_lists:
            meta._build_token_lists(params, device)
        if uses_bad_words:
            meta._build_bad_words(params, output_token_ids, device)
        return meta

    def _build_random(
        self,
        params: Sequence[SamplingParams],
        greedy: list[bool],
        output_token_ids: Sequence[Sequence[int]],
        uses_filter: bool,
        device: torch.device,
    ) -> None:
        V = self.vocab_size
        # Greedy rows take the argmax of the (penalised) logits, so their temperature and
        # filters are neutral values that keep the vectorised ops well defined.
        self.temperature = torch.tensor(
            [1.0 if g else p.temperature for p, g in zip(params, greedy)], dtype=torch.float32, device=device
        )
        if not self.all_random:
            self.is_greedy = torch.tensor(greedy, dtype=torch.bool, device=device)
        for row, (p, g) in enumerate(zip(params, greedy)):
            if not g and p.seed is not None:
                self.generators[row] = _make_generator(seed_for_step(p.seed, len(output_token_ids[row])), device)
        if not uses_filter:
            return
        rows = [(p, g) for p, g in zip(params, greedy)]
        ks = [V if g or p.top_k == 0 else min(p.top_k, V) for p, g in rows]
        if any(k < V for k in ks):
            self.top_k = torch.tensor(ks, dtype=torch.int64, device=device)
            self.max_top_k = max(k for k in ks if k < V)
        if any(not g and p.top_p < 1.0 for p, g in rows):
            self.top_p = torch.tensor([1.0 if g else p.top_p for p, g in rows], dtype=torch.float32, device=device)
        if any(not g and p.min_p > 0.0 for p, g in rows):
            self.min_p = torch.tensor([0.0 if g else p.min_p for p, g in rows], dtype=torch.float32, device=device)

    def _build_penalties(
        self,
        params: Sequence[SamplingParams],
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]],
        device: torch.device,
    ) -> None:
        presence = [p.presence_penalty for p in params]
        frequency = [p.frequency_penalty for p in params]
        repetition = [p.repetition_penalty for p in params]
        if any(v != 0.0 for v in presence):
            self.presence_penalty = torch.tensor(presence, dtype=torch.float32, device=device)
        if any(v != 0.0 for v in frequency):
            self.frequency_penalty = torch.tensor(frequency, dtype=torch.float32, device=device)
        if any(v != 1.0 for v in repetition):
            self.repetition_penalty = torch.tensor(repetition, dtype=torch.float32, device=device)
            self.prompt_token_mask = _token_counts(prompt_token_ids, self.vocab_size, device) > 0
        self.output_token_counts = _token_counts(output_token_ids, self.vocab_size, device)

    def _build_min_tokens(
        self,
        params: Sequence[SamplingParams],
        output_token_ids: Sequence[Sequence[int]],
        eos_token_ids: Collection[int] | Sequence[Collection[int]],
        device: torch.device,
    ) -> None:
        eos_per_row = _eos_per_row(eos_token_ids, len(params))
        rows: list[int] = []
        token_ids: list[int] = []
        for row, p in enumerate(params):
            if p.min_tokens <= len(output_token_ids[row]):
                continue
            stop_ids = set(p.stop_token_ids)
            if not p.ignore_eos:
                stop_ids.update(eos_per_row[row])
            for tid in stop_ids:
                if 0 <= tid < self.vocab_size:  # ids past the logits (added tokens) cannot be sampled anyway
                    rows.append(row)
                    token_ids.append(tid)
        if rows:
            self.min_tokens_rows = torch.tensor(rows, dtype=torch.int64, device=device)
            self.min_tokens_token_ids = torch.tensor(token_ids, dtype=torch.int64, device=device)

    def _build_token_lists(self, params: Sequence[SamplingParams], device: torch.device) -> None:
        """logit_bias and allowed_token_ids. Ids past the logits (refused when the request was
        added) are dropped here too, so a stale id can never index out of bounds; a list left
        with no id in range restricts nothing, rather than leave its row nothing to sample."""
        V = self.vocab_size
        bias: list[tuple[int, int, float]] = []  # (row, token id, bias)
        allowed: list[tuple[int, int]] = []  # (row, token id)
        restricted: list[int] = []
        for row, p in enumerate(params):
            bias.extend((row, tid, float(b)) for tid, b in (p.logit_bias or {}).items() if 0 <= tid < V)
            ids = [tid for tid in p.allowed_token_ids or () if 0 <= tid < V]
            if ids:
                restricted.append(row)
                allowed.extend((row, tid) for tid in ids)
        if bias:
            rows, token_ids, values = zip(*bias)
            self.bias_rows = torch.tensor(rows, dtype=torch.int64, device=device)
            self.bias_token_ids = torch.tensor(token_ids, dtype=torch.int64, device=device)
            self.bias_values = torch.tensor(values, dtype=torch.float32, device=device)
        if restricted:
            disallowed = torch.zeros(self.num_reqs, V, dtype=torch.bool, device=device)
            disallowed[torch.tensor(restricted, dtype=torch.int64, device=device)] = True
            rows, token_ids = (torch.tensor(col, dtype=torch.int64, device=device) for col in zip(*allowed))
            self.disallowed = disallowed.index_put_((rows, token_ids), torch.tensor(False, device=device))

    def _build_bad_words(
        self, params: Sequence[SamplingParams], output_token_ids: Sequence[Sequence[int]], device: torch.device
    ) -> None:
        """vLLM's rule: a banned sequence bans its last token where the output ends with the rest
        of it (a one-token sequence: always). On the host: O(total banned tokens) per row."""
        rows: list[int] = []
        token_ids: list[int] = []
        for row, p in enumerate(params):
            if not p.bad_words_token_ids:
                continue
            out = output_token_ids[row]
            out = out if isinstance(out, list) else list(out)
            for seq in p.bad_words_token_ids:
                prefix = len(seq) - 1
                if prefix > len(out) or not 0 <= seq[-1] < self.vocab_size:
                    continue
                if prefix == 0 or out[-prefix:] == seq[:-1]:
                    rows.append(row)
                    token_ids.append(seq[-1])
        if rows:
            self.banned_rows = torch.tensor(rows, dtype=torch.int64, device=device)
            self.banned_token_ids = torch.tensor(token_ids, dtype=torch.int64, device=device)


def _eos_per_row(
    eos_token_ids: Collection[int] | Sequence[Collection[int]], num_reqs: int
) -> Sequence[Collection[int]]:
    """Accept the model's EOS ids (shared) or one collection per row."""
    ids = [] if eos_token_ids is None else list(eos_token_ids)
    if all(isinstance(tid, int) for tid in ids):
        return [ids] * num_reqs
    if len(ids) != num_reqs or not all(isinstance(row, Collection) for row in ids):
        raise ValueError(
            f"eos_token_ids must be a collection of token ids shared by every request, or one "
            f"collection per request ({num_reqs}); got {eos_token_ids!r}"
        )
    return ids


def _token_counts(token_ids: Sequence[Sequence[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[R, V] float32: how often each token id occurs in each row's list."""
    num_rows = len(token_ids)
    max_len = max((len(ids) for ids in token_ids), default=0)
    counts = torch.zeros(num_rows, vocab_size + 1, dtype=torch.float32, device=device)
    if max_len == 0:
        return counts[:, :vocab_size]
    # Pad with the spare column V so every row scatters max_len ones; then drop it.
    padded = [list(ids) + [vocab_size] * (max_len - len(ids)) for ids in token_ids]
    index = torch.tensor(padded, dtype=torch.int64, device=device)  # [R, max_len]
    # Ids the logits do not cover cannot be penalised: send them to the spare column too
    # (checked on device, so no host sync).
    index = torch.where((index >= 0) & (index < vocab_size), index, vocab_size)
    counts.scatter_add_(1, index, torch.ones_like(index, dtype=torch.float32))
    return counts[:, :vocab_size]


# What changes a row's logits before its token is picked (SamplingMetadata.build and takes_argmax_only)
def _uses_penalty(p: SamplingParams) -> bool:
    return p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0


def _masks_min_tokens(p: SamplingParams, num_output_tokens: int) -> bool:
    return p.min_tokens > num_output_tokens


def _uses_token_lists(p: SamplingParams) -> bool:
    return bool(p.logit_bias) or p.allowed_token_ids is not None


def takes_argmax_only(params: SamplingParams, num_output_tokens: int) -> bool:
    """A request whose next token is the argmax of its raw logits and whose logits nothing else reads this step:
    greedy, no logprobs, no penalties, logit bias, allowed tokens, bad words or structured output, and min_tokens
    already met (``num_output_tokens`` generated so far, or fewer). What ``Sampler.sample`` does to such a row is
    one ``max``; the model runner tells the LM head so (``forward_context.set_argmax_rows``)."""
    p = params
    return (p.temperature < SAMPLING_EPS and p.logprobs is None and not _uses_penalty(p)
            and not _masks_min_tokens(p, num_output_tokens) and not _uses_token_lists(p)
            and not p.bad_words_token_ids and p.structured_outputs is None)
