"""What the engine hands back to users, per request and step (the shape of vLLM's outputs)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "abort"]


@dataclass(slots=True)
class Logprob:
    """One token's log-probability under the model's raw distribution."""

    logprob: float
    rank: int | None = None  # 1-based rank in the distribution; None when unknown
    decoded_token: str | None = None  # the token's text, when detokenized


# One dict per generated token: the sampled token and the top-k alternatives, by token id.
SampleLogprobsDicts = list[dict[int, Logprob]]


@dataclass
class CompletionOutput:
    """One of a request's ``n`` completions, so far (streaming) or final."""

    index: int  # which of the request's n completions
    text: str  # generated text (without a matched stop string unless include_stop_str_in_output)
    token_ids: list[int]  # generated token ids
    cumulative_logprob: float | None  # sum of the sampled tokens' logprobs; None when logprobs not asked
    logprobs: SampleLogprobsDicts | None  # per generated token; None when not asked
    finish_reason: FinishReason | None = None  # None while still running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it; None for EOS/length
    # with logprobs: where each token's text starts in ``text`` (capped at its length once a
    # stop string cut it); None otherwise
    text_offsets: list[int] | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    """Timestamps (``time.time()`` seconds) of one request's life."""

    arrival_time: float
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    first_scheduled_time: float | None = None  # when the scheduler first admitted it (queue time = this - arrival)


@dataclass
class RequestOutput:
    """One request's state as returned by ``LLM.generate`` or each engine step."""

    request_id: str
    prompt: str | None  # None when the request came as token ids
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    metrics: RequestMetrics | None = None
    # prompt_logprobs asked: None for the first prompt token, then one dict per prompt token
    # (the token and the top alternatives); None when not asked
    prompt_logprobs: list[dict[int, Logprob] | None] | None = field(default=None)
    embedding: list[float] | None = None  # an embedding request's (pooling params set), once finished
    probs: list[float] | None = None  # a classify request's class probabilities (raw logits without activation)


@dataclass(slots=True)
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """What ``LLM.embed`` returns per prompt (vLLM's shape)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True


@dataclass(slots=True)
class ClassificationOutput:
    probs: list[float]  # per class (id2label order): probabilities, or raw logits with activation=False

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationRequestOutput:
    """What ``LLM.classify`` returns per prompt (vLLM's shape)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ClassificationOutput
    finished: bool = True


@dataclass(slots=True)
class ScoringOutput:
    score: float  # the cosine similarity of the pair's embeddings, in [-1, 1]


@dataclass
class ScoringRequestOutput:
    """What ``LLM.score`` returns per pair (vLLM's shape)."""

    request_id: str  # "<first text's embedding request id>_<second's>"
    prompt_token_ids: list[int]  # the first text's tokens, then the second's
    outputs: ScoringOutput
    finished: bool = True
