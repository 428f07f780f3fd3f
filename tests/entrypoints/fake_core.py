"""A stand-in EngineCore (token ids only, no model) and a character-level tokenizer, so
AsyncLLM's threading, abort and failure paths are tested in milliseconds."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

from halserve.engine.types import EngineStats
from halserve.engine_core_output import EngineCoreOutput

ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789 +="


def char_tokenizer():
    """A PreTrainedTokenizerFast with one token per character of ALPHABET (+ <s>, </s>)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<s>": 0, "</s>": 1, **{c: i + 2 for i, c in enumerate(ALPHABET)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="</s>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


@dataclass
class FakeModelInfo:
    vocab_size: int = len(ALPHABET) + 2
    max_model_len: int = 64
    eos_token_ids: list[int] = field(default_factory=lambda: [1])
    generation_defaults: dict | None = None
    model_path: str = "fake"


class FakeCore:
    """Each step emits, for every running request, the token after its last one (ids cycle
    through the letters, never eos). ``fail_after`` steps make ``step`` raise."""

    def __init__(self, fail_after: int | None = None, step_delay: float = 0.0) -> None:
        self.model_info = FakeModelInfo()
        self.running: dict[str, list] = {}  # id -> [last token, generated, max_tokens]
        self.aborted: list[str] = []
        self.num_steps = 0
        self.fail_after = fail_after
        self.step_delay = step_delay
        self.threads: set[str] = set()
        self.is_shut_down = False

    def add_request(self, req) -> None:
        self.threads.add(threading.current_thread().name)
        if len(req.prompt_token_ids) > 40:
            raise ValueError("the prompt can never fit in the KV cache")
        self.running[req.request_id] = [req.prompt_token_ids[-1], 0, req.max_tokens]

    def step(self) -> list[EngineCoreOutput]:
        import time

        self.threads.add(threading.current_thread().name)
        self.num_steps += 1
        if self.fail_after is not None and self.num_steps > self.fail_after:
            raise RuntimeError("simulated device failure")
        if self.step_delay:
            time.sleep(self.step_delay)
        outputs = []
        for rid, state in list(self.running.items()):
            token = 2 + (state[0] - 2 + 1) % 26
            state[0] = token
            state[1] += 1
            done = state[1] >= state[2]
            outputs.append(EngineCoreOutput(rid, [token], None, "length" if done else None))
            if done:
                del self.running[rid]
        return outputs

    def abort_requests(self, ids: list[str]) -> None:
        for rid in ids:
            if self.running.pop(rid, None) is not None:
                self.aborted.append(rid)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running)

    def get_stats(self) -> EngineStats:
        return EngineStats(num_running=len(self.running), num_steps=self.num_steps)

    def shutdown(self) -> None:
        self.is_shut_down = True


def make_async_llm(core: FakeCore):
    from halserve.engine.async_llm import AsyncLLM
    from halserve.engine.output_processor import OutputProcessor
    from halserve.engine.processor import InputProcessor

    tokenizer = char_tokenizer()
    return AsyncLLM(core, InputProcessor(core.model_info, tokenizer), OutputProcessor(tokenizer), tokenizer)
