"""Per-request sampling parameters, with vLLM's names, defaults and semantics.

Built once per request (by the user, the ``LLM`` API or the server) and read by the
scheduler, the sampler and the detokenizer, so construction stays cheap: a slots
dataclass, one validation pass, no copies beyond normalising ``stop``/``stop_token_ids``.
"""
from __future__ import annotations

import copy
import enum
import functools
import math
from dataclasses import dataclass, field, fields
from typing import Any

from halserve.pooling_params import PoolingParams
from halserve.structured_output import CONSTRAINTS, StructuredOutputsParams

# Temperatures below this are greedy (argmax), as in vLLM.
SAMPLING_EPS = 1e-5
# Upper bound of ``logprobs`` (top alternatives returned per token), as vLLM's default max_logprobs.
MAX_LOGPROBS = 20
_FLOAT32_TINY = 1.1754943508222875e-38  # the smallest normal float32: logits are divided by the penalty

# HF generation_config keys that become model defaults (vLLM reads the same ones);
# the value is the SamplingParams field each one sets.
_GENERATION_CONFIG_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "max_new_tokens": "max_tokens",
    "max_tokens": "max_tokens",
}


class SamplingType(enum.IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


@dataclass(slots=True, kw_only=True)
class SamplingParams:
    """How to sample one request's completion(s). Invalid values raise ``ValueError``."""

    n: int = 1
    """Completions to return for the prompt (needs temperature > 0 when > 1)."""
    temperature: float = 1.0
    """0 means greedy; higher flattens the distribution."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability sums to >= top_p, in (0, 1]."""
    top_k: int = 0
    """Keep the top_k most likely tokens; 0 or -1 keeps all (stored as 0)."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the most likely token's, in [0, 1]."""
    seed: int | None = None
    """Per-request seed: the same seed gives the same tokens whatever else is batched."""
    max_tokens: int | None = 16
    """Most tokens to generate; None lets the request run up to max_model_len."""
    min_tokens: int = 0
    """Tokens to generate before EOS, stop_token_ids or stop strings may end the request."""
    stop: str | list[str] | None = None
    """Strings that end generation (normalised to a list); the text is cut before them."""
    stop_token_ids: list[int] | None = None
    """Token ids that end generation besides EOS (normalised to a list)."""
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    """Keep generating after EOS (benchmarks)."""
    logprobs: int | None = None
    """Top alternatives to return per generated token besides the sampled one, 0..20; None: none."""
    prompt_logprobs: int | None = None
    """Logprobs of the prompt's tokens (each scored by the model given the ones before it)
    plus this many top alternatives, 0..20; None: none. Such a request computes its whole
    prompt (no prefix-cache hits): every position's logits are needed."""
    presence_penalty: float = 0.0
    """Subtracted once from the logit of every token already generated, in [-2, 2]."""
    frequency_penalty: float = 0.0
    """Subtracted per occurrence from the logit of tokens already generated, in [-2, 2]."""
    repetition_penalty: float = 1.0
    """HF-style: > 1 discourages tokens seen in the prompt or the output; must be > 0."""
    logit_bias: dict[int, float] | None = None
    """Added to the logits of these token ids before sampling (and before the penalties);
    -100 bans a token in practice, 100 all but forces it. Not reflected in logprobs."""
    allowed_token_ids: list[int] | None = None
    """Only these token ids may be sampled (EOS too must be listed to end early)."""
    bad_words: list[str] | None = None
    """Words never to generate (vLLM's): each is tokenized as given (left-stripped) and with a
    leading space; a token is banned at a step where it would complete one of these token
    sequences (a one-token word is banned at every step). The ban is on token sequences, so
    the same text spelt with other tokens is not caught. At most 128 sequences in all."""
    truncate_prompt_tokens: int | None = None
    """Keep only the last k tokens of the tokenized prompt, k >= 1 and at most max_model_len;
    -1 keeps as many as leave room for max_tokens (max_model_len - max_tokens, as recent vLLM;
    max_model_len - 1 without max_tokens). None keeps it whole. A text prompt cut this way
    comes back with ``prompt`` None (its text no longer matches ``prompt_token_ids``)."""
    structured_outputs: StructuredOutputsParams | None = None
    """Constrain the output to a JSON schema, any JSON object, a regex, a choice of strings or
    an EBNF grammar (a dict of StructuredOutputsParams' fields is accepted too); needs xgrammar."""
    pooling: PoolingParams | None = None
    """Set by ``LLM.embed`` / /v1/embeddings and ``LLM.classify`` / /classify: return the prompt's
    embedding or class probabilities (``pooling.task``); the request then generates no token."""
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True

    # bad_words as token-id sequences, set by the InputProcessor (it has the tokenizer); read by
    # the sampler. None until then, and for a request without bad_words.
    bad_words_token_ids: list[list[int]] | None = field(default=None, init=False, repr=False, compare=False)
    # Names of the fields the caller passed (model defaults never override them).
    _explicit: frozenset[str] = field(default=frozenset(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        stop = self.stop
        if stop is None:
            self.stop = []
        elif isinstance(stop, str):
            self.stop = [stop]
        elif isinstance(stop, (list, tuple)):
            self.stop = list(stop)
        else:
            raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, (list, tuple)):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
        self.stop_token_ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a dict of token id -> bias, got {self.logit_bias!r}")
            self.logit_bias = dict(self.logit_bias) or None
        if self.allowed_token_ids is not None:
            if isinstance(self.allowed_token_ids, (str, bytes)) or not hasattr(self.allowed_token_ids, "__iter__"):
                raise ValueError(f"allowed_token_ids must be a list of token ids, got {self.allowed_token_ids!r}")
            self.allowed_token_ids = list(self.allowed_token_ids)
        if self.bad_words is not None:
            if not isinstance(self.bad_words, (list, tuple)):
                raise ValueError(f"bad_words must be a list of strings, got {self.bad_words!r}")
            self.bad_words = list(self.bad_words) or None
        if isinstance(self.structured_outputs, dict):
            known = {f.name for f in fields(StructuredOutputsParams)}
            unknown = sorted(set(self.structured_outputs) - known)
            if unknown:
                raise ValueError(f"structured_outputs: unknown field(s) {', '.join(unknown)}; "
                                 f"give one of {', '.join(CONSTRAINTS)}")
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        elif self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(
                f"structured_outputs must be a StructuredOutputsParams or a dict, got {self.structured_outputs!r}"
            )
        if self.top_k == -1:
            self.top_k = 0
        self._verify()

    def _verify(self) -> None:
        n = self.n
        if type(n) is not int or n < 1:
            raise ValueError(f"n must be an integer >= 1, got {n!r}")
        t = self.temperature
        if not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        if n > 1 and t < SAMPLING_EPS:
            raise ValueError(
                f"n={n} asks for several completions but temperature={t!r} is greedy, so they "
                "would all be identical; set temperature > 0 or n=1"
            )
        p = self.top_p
        if not isinstance(p, (int, float)) or not 0.0 < p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {p!r}")
        k = self.top_k
        if type(k) is not int or k < -1:
            raise ValueError(f"top_k must be an integer >= 1, or 0 / -1 to keep all tokens, got {k!r}")
        mp = self.min_p
        if not isinstance(mp, (int, float)) or not 0.0 <= mp <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {mp!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        rp = self.repetition_penalty
        if not isinstance(rp, (int, float)) or not _FLOAT32_TINY <= rp <= 1 / _FLOAT32_TINY:
            raise ValueError(f"repetition_penalty must be a finite number > 0 (1 = no penalty) within float32's "
                             f"range [{_FLOAT32_TINY:g}, {1 / _FLOAT32_TINY:g}], got {rp!r}")
        mt = self.max_tokens
        if mt is not None and (type(mt) is not int or mt < 1):
            raise ValueError(f"max_tokens must be an integer >= 1 or None (up to max_model_len), got {mt!r}")
        mn = self.min_tokens
        if type(mn) is not int or mn < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {mn!r}")
        if mt is not None and mn > mt:
            raise ValueError(f"min_tokens ({mn}) must be <= max_tokens ({mt})")
        for name in ("logprobs", "prompt_logprobs"):
            lp = getattr(self, name)
            if lp is not None and (type(lp) is not int or not 0 <= lp <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be None or an integer in [0, {MAX_LOGPROBS}], got {lp!r}")
        seed = self.seed
        if seed is not None and type(seed) is not int:
            raise ValueError(f"seed must be an integer or None, got {seed!r}")
        if self.stop:
            for s in self.stop:
                if not isinstance(s, str) or not s:
                    raise ValueError(f"stop strings must be non-empty strings, got {s!r} in stop={self.stop!r}")
            if not self.detokenize:
                raise ValueError(f"stop={self.stop!r} needs detokenize=True: stop strings are matched on the text")
        for tid in self.stop_token_ids or ():
            if type(tid) is not int or tid < 0:
                raise ValueError(f"stop_token_ids must be non-negative integers, got {tid!r}")
        for tid, bias in (self.logit_bias or {}).items():
            if type(tid) is not int or tid < 0:
                raise ValueError(
                    f"logit_bias keys must be non-negative integer token ids, got {tid!r} in {self.logit_bias!r}"
                )
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias):
                raise ValueError(f"logit_bias values must be finite numbers, got {bias!r} in {self.logit_bias!r}")
        if self.logit_bias:  # OpenAI's range (vLLM's server clamps to it too): beyond it float32 logits overflow
            self.logit_bias = {tid: min(100.0, max(-100.0, float(bias))) for tid, bias in self.logit_bias.items()}
        allowed = self.allowed_token_ids
        if allowed is not None:
            if not allowed:
                raise ValueError(f"allowed_token_ids={allowed!r} must not be empty (no token could be sampled); "
                                 "leave it unset to allow every token")
            for tid in allowed:
                if type(tid) is not int or tid < 0:
                    raise ValueError(
                        f"allowed_token_ids must be non-negative integer token ids, got {tid!r} in {allowed!r}"
                    )
        for word in self.bad_words or ():
            if not isinstance(word, str) or not word.strip():
                raise ValueError(f"bad_words must be non-blank strings, got {word!r} in {self.bad_words!r}")
        truncate = self.truncate_prompt_tokens
        if truncate is not None and (type(truncate) is not int or (truncate < 1 and truncate != -1)):
            raise ValueError("truncate_prompt_tokens must be an integer >= 1, or -1 for max_model_len, "
                             f"got {truncate!r}")

    def check_token_ids(self, vocab_size: int) -> None:
        """ValueError if a token id named by logit_bias, allowed_token_ids or the structured
        outputs' start_after / opened_by is past the model's vocabulary (checked when a request
        is added, where the vocabulary is known)."""
        constraint = self.structured_outputs
        marker = (constraint.start_after or ()) if constraint is not None else ()
        opener = (constraint.opened_by,) if constraint is not None and constraint.opened_by is not None else ()
        for name, ids in (("logit_bias", self.logit_bias or ()), ("allowed_token_ids", self.allowed_token_ids or ()),
                          ("structured_outputs.start_after", marker), ("structured_outputs.opened_by", opener)):
            for tid in ids:
                if tid >= vocab_size:
                    raise ValueError(
                        f"{name} names token id {tid}, out of range: the model's vocabulary has {vocab_size} "
                        f"tokens, so ids must be in [0, {vocab_size - 1}]"
                    )

    # ------------------------------------------------------------------ derived
    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < SAMPLING_EPS:
            return SamplingType.GREEDY
        return SamplingType.RANDOM if self.seed is None else SamplingType.RANDOM_SEED

    @property
    def output_text_buffer_length(self) -> int:
        """Characters a stream holds back so a stop string's prefix is never sent and then cut."""
        if not self.stop or self.include_stop_str_in_output:
            return 0  # text up to and including a stop string is kept anyway
        return max(len(s) for s in self.stop) - 1

    @property
    def explicit_fields(self) -> frozenset[str]:
        """Fields the caller set (by keyword) rather than left at their default."""
        return self._explicit

    def clone(self) -> SamplingParams:
        """An independent copy (lists are copied too)."""
        new = copy.copy(self)
        new.stop = list(self.stop or ())  # (lists since __post_init__)
        new.stop_token_ids = list(self.stop_token_ids or ())
        if self.logit_bias is not None:
            new.logit_bias = dict(self.logit_bias)
        if self.allowed_token_ids is not None:
            new.allowed_token_ids = list(self.allowed_token_ids)
        if self.bad_words is not None:
            new.bad_words = list(self.bad_words)  # (bad_words_token_ids is shared: never changed in place)
        return new

    def update_from_generation_config(
        self, defaults: dict[str, Any], model_eos_token_id: int | None = None
    ) -> SamplingParams:
        """Apply a model's defaults (its HF ``generation_config``) to the fields the caller
        did not set; returns ``self``.

        Reads temperature, top_p, top_k, min_p, the penalties and ``max_new_tokens`` (as
        ``max_tokens``); other keys (``do_sample``, ``bos_token_id``, ...) are ignored, as in
        vLLM. Extra ``eos_token_id`` values besides ``model_eos_token_id`` (e.g. Llama-3's
        ``<|eot_id|>``) join ``stop_token_ids`` unless ``ignore_eos``.
        """
        explicit = self._explicit
        for key, name in _GENERATION_CONFIG_FIELDS.items():
            value = defaults.get(key)
            if value is None or name in explicit:
                continue
            if name == "top_k" and value == -1:
                value = 0
            setattr(self, name, value)
        eos = defaults.get("eos_token_id")
        if eos is not None and not self.ignore_eos:
            eos_ids = [eos] if isinstance(eos, int) else list(eos)
            assert self.stop_token_ids is not None  # (a list since __post_init__)
            for tid in eos_ids:
                if tid != model_eos_token_id and tid not in self.stop_token_ids:
                    self.stop_token_ids.append(tid)
        try:
            self._verify()
        except ValueError as exc:
            raise ValueError(f"the model's generation config gives invalid sampling defaults: {exc}") from None
        return self


def _record_explicit(cls: type[SamplingParams]) -> type[SamplingParams]:
    """Wrap the generated ``__init__`` so each instance remembers which keywords it got.
    All fields are keyword-only, so the keywords are exactly the fields the caller set."""
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self: SamplingParams, **kwargs: Any) -> None:
        init(self, **kwargs)
        self._explicit = frozenset(kwargs)

    cls.__init__ = __init__  # type: ignore[method-assign]
    return cls


_record_explicit(SamplingParams)

FIELD_NAMES = tuple(f.name for f in fields(SamplingParams) if f.init)
