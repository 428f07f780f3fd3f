"""``--enable-log-requests``: one structured log line per finished request.

The line is ``request {json}`` on the ``halserve.requests`` logger (INFO), the JSON object
holding: id, model, lora (adapter name or null), prompt_tokens, generated_tokens,
cached_tokens, n, finish_reason, and the times in seconds -- queue_s (arrival to first
scheduled), ttft_s, prefill_s (first scheduled to first token), decode_s (first to last
token), inference_s (first scheduled to last token), e2e_s (arrival to finish); a phase the
request never reached is null. The prompt's text is logged only with ``--log-request-prompts``
(prompts may hold personal data), cut to ``max_prompt_chars``.
"""
from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING

from halserve.engine.request_stream import FinishedRequestObserver

if TYPE_CHECKING:  # pragma: no cover
    from halserve.engine.request_stream import FinishedRequestStats

__all__ = ["RequestLogger", "request_log_record"]

logger = logging.getLogger("halserve.requests")


def _seconds(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


def request_log_record(stats: FinishedRequestStats, model_name: str, log_prompts: bool = False,
                       max_prompt_chars: int | None = None) -> dict:
    """The fields of one request's log line."""
    record: dict = {
        "id": stats.request_id,
        "model": model_name,
        "lora": stats.lora_name,
        "prompt_tokens": stats.num_prompt_tokens,
        "generated_tokens": stats.num_generation_tokens,
        "cached_tokens": stats.num_cached_tokens,
        "n": stats.n,
        "finish_reason": stats.finish_reason,
        "queue_s": _seconds(stats.queue_time),
        "ttft_s": _seconds(stats.ttft),
        "prefill_s": _seconds(stats.prefill_time),
        "decode_s": _seconds(stats.decode_time),
        "inference_s": _seconds(stats.inference_time),
        "e2e_s": _seconds(stats.e2e_time),
    }
    if log_prompts:
        prompt = stats.prompt_text
        if prompt is not None and max_prompt_chars is not None:
            prompt = prompt[:max_prompt_chars]
        record["prompt"] = prompt
    return record


class RequestLogger(FinishedRequestObserver):
    """An ``AsyncLLM`` stats observer writing one line per finished request (see the module docstring)."""

    def __init__(self, model_name: str, log_prompts: bool = False, max_prompt_chars: int | None = None) -> None:
        if max_prompt_chars is not None and max_prompt_chars < 0:
            raise ValueError(f"max_prompt_chars {max_prompt_chars}: must be >= 0 (None: whole prompts)")
        self.model_name = model_name
        if logger.level == logging.NOTSET:  # (asked for explicitly: shown even under --log-level warning)
            logger.setLevel(logging.INFO)
        self.log_prompts = log_prompts
        self.max_prompt_chars = max_prompt_chars

    def on_request_stats(self, stats: FinishedRequestStats) -> None:
        record = request_log_record(stats, self.model_name, self.log_prompts, self.max_prompt_chars)
        logger.info("request %s", json.dumps(record, ensure_ascii=False))
