"""Input processing: validate, tokenize (expanding a prompt's images), fan out n samples. Output
processing (detokenization, ``RequestOutput``s) is ``output_processor.py``.

Both run outside the step loop: LLMEngine calls them in its own thread, AsyncLLM on
the asyncio side while the core steps in its engine thread.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from halserve.engine.types import EngineCoreRequest
from halserve.pooling_params import check_task
from halserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from halserve.models.loader import ModelInfo
    from halserve.multimodal.processing import MultiModalProcessor

PromptType = str | list[int] | dict


# A text prompt over this many characters per token of the context is checked from its start first.
_CHARS_PER_TOKEN_BOUND = 16
# bad_words: token sequences a request may ban; each is matched against the end of its output
# at every step, on the host.
MAX_BAD_WORDS = 128


def check_text_length(tokenizer: Any, prompt: str, max_len: int) -> None:
    """A text far longer than the context is refused from its start alone, so a huge prompt
    costs a bounded tokenization (and memory), not one of its whole length."""
    head = _CHARS_PER_TOKEN_BOUND * max_len
    if len(prompt) > head:
        count = len(tokenizer.encode(prompt[:head], add_special_tokens=False))
        if count >= max_len:
            raise ValueError(
                f"the prompt is longer than the model's maximum context length (max_model_len) of {max_len} "
                f"tokens: its first {head} of {len(prompt)} characters alone are {count} tokens; shorten the prompt"
            )


def tokenize_bad_words(tokenizer: Any, words: list[str], vocab_size: int) -> list[list[int]]:
    """The bad_words as token sequences: each word left-stripped, tokenized without special tokens
    as it starts a text ("fox") and with a leading space as it follows a word (" fox"), both
    kept unless equal. (vLLM keeps the spaced form only when it has as many tokens as the other,
    so a "fox" of two tokens would leave a one-token " fox" unbanned.) ValueError for a word with
    no token, more than ``MAX_BAD_WORDS`` sequences, or a token past the model's vocabulary."""
    sequences: list[list[int]] = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not plain:
            raise ValueError(f"bad_words entry {word!r} tokenizes to no token; remove it")
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        for seq in (plain, spaced):
            if seq and seq not in sequences:
                sequences.append(seq)
        if len(sequences) > MAX_BAD_WORDS:
            raise ValueError(f"bad_words tokenize to more than {MAX_BAD_WORDS} token sequences "
                             f"({len(words)} words, each with and without a leading space); give fewer words")
    invalid = sorted({tid for seq in sequences for tid in seq if not 0 <= tid < vocab_size})
    if invalid:
        raise ValueError(f"bad_words tokenize to token ids {invalid}, past the model's vocabulary of {vocab_size} "
                         f"tokens (ids must be in [0, {vocab_size - 1}]); remove the words that hold them")
    return sequences


def child_request_id(parent_id: str, index: int, n: int) -> str:
    return parent_id if n == 1 else f"{index}_{parent_id}"


class InputProcessor:
    def __init__(self, model_info: ModelInfo, tokenizer: Any, *, reject_max_tokens_past_context: bool = False) -> None:
        """``reject_max_tokens_past_context``: a ``max_tokens`` larger than what the context leaves after the
        prompt is an error (the OpenAI server, as vLLM's and OpenAI's: 400) instead of being cut to that room
        (the offline ``LLM``, as vLLM's, where generation stops at max_model_len with finish_reason "length")."""
        self.info = model_info
        self.tokenizer = tokenizer
        self.reject_max_tokens_past_context = reject_max_tokens_past_context
        self.vocab_size = model_info.vocab_size
        self._mm_processor: MultiModalProcessor | None = None
        if getattr(model_info, "image_processor_kwargs", None):
            _ = self.mm_processor.image_processor  # (bad mm_processor_kwargs: an error at start-up, not per request)

    @property
    def mm_processor(self):
        """The image preprocessing of a vision-language model (built on first use)."""
        if self._mm_processor is None:
            from halserve.multimodal.processing import MultiModalProcessor

            self._mm_processor = MultiModalProcessor(self.info, tokenizer=self.tokenizer)
        return self._mm_processor

    def _multimodal(self, prompt: PromptType, ids: list[int], params: SamplingParams):
        """``(ids with each image's placeholders expanded, its features, M-RoPE positions or None)``
        for a prompt dict with ``multi_modal_data``; ``(ids, None, None)`` for any other prompt."""
        mm_data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
        if mm_data is None:
            return ids, None, None
        if not self.info.is_multimodal:
            raise ValueError(f"model {self.info.architecture} takes no images (multi_modal_data); send text only, "
                             "or serve a vision-language model such as LlavaForConditionalGeneration")
        if params.truncate_prompt_tokens is not None:
            raise ValueError("truncate_prompt_tokens cannot be combined with images (it could cut an image's "
                             "placeholder tokens); shorten the text instead")
        return self.mm_processor.process(ids, mm_data)

    def tokenize(self, prompt: PromptType, check_length: bool = True,
                 allow_images: bool = False) -> tuple[str | None, list[int]]:
        """(prompt text or None, token ids); ValueError for anything malformed. ``check_length``
        False: a text far longer than the context is tokenized whole (it is to be truncated).
        A prompt with images is refused unless ``allow_images`` (``process`` handles them; beam
        search does not)."""
        if isinstance(prompt, dict):
            if prompt.get("multi_modal_data") is not None and not allow_images:
                raise ValueError("this request kind does not take images (multi_modal_data), e.g. beam search; "
                                 "send the prompt without them or use sampling")
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._check_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError(
                    f"a prompt dict needs 'prompt' (text) or 'prompt_token_ids' (list of ints); got keys {sorted(prompt)}"
                )
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty; give at least one character or token")
            if check_length:
                check_text_length(self.tokenizer, prompt, self.info.max_model_len)
            ids = self.tokenizer.encode(prompt)
            bad = max(ids, default=-1)
            if bad >= self.vocab_size:  # (a token the tokenizer has and the model lacks: refused here, not an
                # IndexError in the step that would fail every request in it)
                raise ValueError(f"the prompt holds the token {self.tokenizer.convert_ids_to_tokens(bad)!r} (id {bad}), "
                                 f"which the model's vocabulary of {self.vocab_size} tokens lacks (its tokenizer has "
                                 "tokens its embedding does not); remove that text from the prompt")
            return prompt, ids
        if isinstance(prompt, (list, tuple)):
            return None, self._check_ids(prompt)
        raise ValueError(f"a prompt must be a string, a list of token ids or a dict; got {type(prompt).__name__}")

    def _check_ids(self, ids: Any) -> list[int]:
        if not isinstance(ids, (list, tuple)):
            raise ValueError(f"prompt_token_ids must be a list of ints, got {type(ids).__name__}")
        if len(ids) == 0:
            raise ValueError("the prompt token list is empty; give at least one token id")
        out = []
        for tok in ids:
            if isinstance(tok, bool) or not isinstance(tok, int):
                raise ValueError(f"prompt token ids must be ints, got {tok!r}")
            if tok < 0 or tok >= self.vocab_size:
                raise ValueError(
                    f"prompt token id {tok} is out of range: the model's vocabulary has {self.vocab_size} "
                    f"tokens, so ids must be in [0, {self.vocab_size - 1}]"
                )
            out.append(tok)
        return out

    def _num_tokens_to_keep(self, params: SamplingParams) -> int | None:
        """truncate_prompt_tokens resolved: None (keep all) or how many of the prompt's last
        tokens to keep. -1 keeps as many as leave room for max_tokens (vLLM's max_model_len -
        max_tokens; at least one token's room: a request always generates one)."""
        k, max_len = params.truncate_prompt_tokens, self.info.max_model_len
        if k == -1 and params.pooling is not None:
            k = max_len  # (an embedding input may fill the context, as in vLLM)
        elif k == -1:
            k = max_len - (params.max_tokens or 1)
            if k < 1:
                raise ValueError(f"truncate_prompt_tokens=-1 keeps max_model_len - max_tokens = {max_len} - "
                                 f"{params.max_tokens} = {k} prompt tokens; ask for fewer than {max_len} tokens")
        elif k is not None and k > max_len:
            raise ValueError(f"truncate_prompt_tokens value ({k}) is greater than max_model_len ({max_len}); "
                             "select a smaller truncation size")
        return k

    def process(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float | None = None,
        prompt_token_ids: list[int] | None = None,
        lora_request: Any = None,
        priority: int = 0,
    ) -> tuple[str | None, list[EngineCoreRequest]]:
        """Validate and tokenize one request; returns (prompt text, one core request per sample).
        ``priority``: lower runs first under the ``priority`` scheduling policy (the core checks it)."""
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority must be an integer (lower runs first), got {priority!r}")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        if lora_request is not None:
            from halserve.lora.request import LoRARequest

            if not isinstance(lora_request, LoRARequest):
                raise ValueError(f"lora_request must be a halserve.LoRARequest, got {type(lora_request).__name__}")
        params.check_token_ids(self.vocab_size)
        max_logprobs = getattr(self.info, "max_logprobs", None)
        for name in ("logprobs", "prompt_logprobs"):
            asked = getattr(params, name)
            if max_logprobs is not None and asked is not None and asked > max_logprobs:
                raise ValueError(f"{name}={asked} is more than this server allows (--max-logprobs {max_logprobs}); "
                                 f"ask for at most {max_logprobs}")
        check_task(params, self.info)  # (a classification model only classifies)
        if params.pooling is not None:
            params.pooling.check(self.info.hidden_size)
            if params.n != 1 or params.structured_outputs is not None:
                raise ValueError("an embedding or classify request takes n=1 and no structured outputs")
        if params.structured_outputs is not None:
            from halserve.structured_output import validate

            validate(params.structured_outputs)
        if bad_words := params.bad_words:
            params = params.clone()  # (the caller's params stay as given)
            params.bad_words_token_ids = tokenize_bad_words(self.tokenizer, bad_words, self.vocab_size)
        keep = self._num_tokens_to_keep(params)
        if prompt_token_ids is None:
            text, ids = self.tokenize(prompt, check_length=keep is None, allow_images=True)
        else:
            text, ids = (prompt if isinstance(prompt, str) else None), self._check_ids(prompt_token_ids)
        ids, mm_features, mrope_positions = self._multimodal(prompt, ids, params)
        if keep is not None and len(ids) > keep:
            text, ids = None, ids[-keep:]  # (the text would no longer match the tokens)
        max_len = self.info.max_model_len
        if params.pooling is not None:  # (an embedding input may fill the context: nothing is generated)
            if len(ids) > max_len:
                kind = "a classify" if params.pooling.task == "classify" else "an embedding"
                raise ValueError(f"the input has {len(ids)} tokens but {kind} input may have at most "
                                 f"max_model_len = {max_len}; shorten it or pass truncate_prompt_tokens")
        elif len(ids) >= max_len and keep is not None:
            raise ValueError(f"truncate_prompt_tokens={params.truncate_prompt_tokens} keeps {len(ids)} tokens but a "
                             f"prompt may have at most max_model_len - 1 = {max_len - 1} (the request generates "
                             f"at least one token); keep at most {max_len - 1}, or pass -1")
        elif len(ids) >= max_len:
            raise ValueError(
                f"the prompt has {len(ids)} tokens but the model's maximum context length (max_model_len) "
                f"is {max_len}, which leaves no room to generate; shorten the prompt"
            )
        room = max(max_len - len(ids), 1)  # (an embedding request's one token is never computed)
        if (self.reject_max_tokens_past_context and params.pooling is None and params.max_tokens is not None
                and params.max_tokens > room):
            raise ValueError(
                f"max_tokens={params.max_tokens} is too large: the model's maximum context length (max_model_len) is "
                f"{max_len} tokens and the prompt has {len(ids)}, which leaves room for {room} generated tokens "
                f"({params.max_tokens} > {max_len} - {len(ids)}); ask for at most {room}, or omit max_tokens to "
                "generate up to the context's end"
            )
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        eos = set() if params.ignore_eos else set(self.info.eos_token_ids)
        if params.min_tokens and params.allowed_token_ids is not None:
            if set(params.allowed_token_ids) <= eos | set(params.stop_token_ids or ()):
                raise ValueError(
                    f"allowed_token_ids={params.allowed_token_ids} holds only stop tokens (EOS or stop_token_ids), "
                    f"which min_tokens={params.min_tokens} forbids at first: no token could be sampled; "
                    "allow other tokens or drop min_tokens"
                )
        arrival = time.time() if arrival_time is None else arrival_time
        children = []
        for i in range(params.n):
            child_params = params
            if params.n > 1:
                child_params = params.clone()
                child_params.n = 1
                if params.seed is not None:  # distinct but reproducible samples
                    child_params.seed = params.seed + i
            children.append(
                EngineCoreRequest(
                    request_id=child_request_id(request_id, i, params.n),
                    parent_id=request_id,
                    index=i,
                    prompt_token_ids=ids,
                    sampling_params=child_params,
                    eos_token_ids=eos,
                    max_tokens=max_tokens,
                    arrival_time=arrival,
                    lora_request=lora_request,
                    mm_features=mm_features,
                    mrope_positions=mrope_positions,
                    priority=priority,
                )
            )
        return text, children

