"""Output processing: incremental detokenization, stop strings, and the ``RequestOutput``s of a
request's samples (its children in the core), assembled from the core's per-step outputs.

Runs outside the step loop, like input processing (``processor.py``).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from halserve.engine.types import EngineCoreRequest
from halserve.outputs import CompletionOutput, FinishReason, Logprob, RequestMetrics, RequestOutput
from halserve.sampling_params import SamplingParams


@dataclass
class _SampleState:
    index: int
    detokenizer: Any  # IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list | None = None
    cumulative_logprob: float | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class _ParentState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: dict[str, _SampleState]  # child request id -> state
    arrival_time: float
    num_cached_tokens: int = 0
    # time.time() stamps (RequestOutput.metrics): the core's first admission of any sample, and
    # when this process saw the first and the latest new tokens
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    prompt_logprobs: list | None = None  # [None, {token: Logprob}, ...] once the prompt is scored
    embedding: list[float] | None = None  # an embedding request's, once computed
    probs: list[float] | None = None  # a classify request's class probabilities (or logits), once computed


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.parents: dict[str, _ParentState] = {}
        self.child_to_parent: dict[str, str] = {}

    def add_request(self, prompt: str | None, children: list[EngineCoreRequest]) -> None:
        from halserve.detokenizer import IncrementalDetokenizer

        first = children[0]
        params = first.sampling_params
        samples = {}
        for child in children:
            p = child.sampling_params
            detok = IncrementalDetokenizer(self.tokenizer, child.prompt_token_ids, p) if p.detokenize else None
            samples[child.request_id] = _SampleState(
                index=child.index,
                detokenizer=detok,
                logprobs=[] if p.logprobs is not None else None,
                cumulative_logprob=0.0 if p.logprobs is not None else None,
            )
            self.child_to_parent[child.request_id] = first.parent_id
        if first.parent_id in self.parents:
            raise ValueError(f"request id {first.parent_id!r} is already in use; give each request a unique id")
        self.parents[first.parent_id] = _ParentState(
            request_id=first.parent_id,
            prompt=prompt,
            prompt_token_ids=first.prompt_token_ids,
            params=params,
            samples=samples,
            arrival_time=first.arrival_time,
        )

    def child_ids(self, parent_id: str) -> list[str]:
        state = self.parents.get(parent_id)
        return list(state.samples) if state else []

    def abort_request(self, parent_id: str) -> list[str]:
        """Forget a parent; returns its children's core ids (to abort in the core)."""
        state = self.parents.pop(parent_id, None)
        if state is None:
            return []
        for child_id in state.samples:
            self.child_to_parent.pop(child_id, None)
        return [cid for cid, s in state.samples.items() if not s.finished]

    def has_unfinished(self) -> bool:
        return bool(self.parents)

    def _logprob_dict(self, entry: Any) -> dict[int, Logprob]:
        decode = self.tokenizer.decode
        out = {entry.token_id: Logprob(entry.logprob, entry.rank, decode([entry.token_id]))}
        for rank, (tok, lp) in enumerate(zip(entry.top_token_ids, entry.top_logprobs), start=1):
            if tok not in out:
                out[tok] = Logprob(lp, rank, decode([tok]))
        return out

    def process_outputs(self, core_outputs: list, final_only: bool = False) -> tuple[list[RequestOutput], list[str]]:
        """Apply one step's core outputs; returns (cumulative outputs of the parents that
        progressed — only the finished ones with ``final_only`` — and child ids the core
        must abort because a stop string matched)."""
        now = time.time()
        touched: dict[str, _ParentState] = {}
        to_abort: list[str] = []
        for out in core_outputs:
            parent_id = self.child_to_parent.get(out.request_id)
            if parent_id is None:
                continue  # aborted meanwhile
            parent = self.parents[parent_id]
            sample = parent.samples[out.request_id]
            if sample.finished:
                continue
            if out.num_cached_tokens:
                parent.num_cached_tokens = max(parent.num_cached_tokens, out.num_cached_tokens)
            if out.prompt_logprobs is not None and parent.prompt_logprobs is None:  # (n > 1: each child sends it)
                # vLLM's shape: None for the first prompt token (nothing scores it), then one dict per token
                parent.prompt_logprobs = [None] + [self._logprob_dict(entry) for entry in out.prompt_logprobs]
            pooling = parent.params.pooling
            if out.pooled is not None and pooling is not None and pooling.task == "classify":
                parent.probs = out.pooled
            elif out.pooled is not None:
                parent.embedding = out.pooled
            if out.scheduled_time is not None and (parent.first_scheduled_time is None
                                                   or out.scheduled_time < parent.first_scheduled_time):
                parent.first_scheduled_time = out.scheduled_time
            new_ids = list(out.new_token_ids)
            if new_ids:
                parent.last_token_time = now
                if parent.first_token_time is None:
                    parent.first_token_time = now
            # A request ended by eos or a stop token id: that token's text is not output (vLLM).
            stop_terminated = out.finish_reason == "stop" and not isinstance(out.stop_reason, str)
            stop_str = None
            if sample.detokenizer is not None and new_ids:
                num_before = len(sample.detokenizer.output_token_ids)
                stop_str = sample.detokenizer.update(new_ids, stop_terminated=stop_terminated)
                if stop_str is not None:  # tokens after the one that completed it are dropped
                    new_ids = new_ids[: len(sample.detokenizer.output_token_ids) - num_before]
            sample.token_ids.extend(new_ids)
            if out.new_logprobs and sample.logprobs is not None:
                for entry in out.new_logprobs[: len(new_ids)]:
                    if entry is None:
                        continue
                    sample.logprobs.append(self._logprob_dict(entry))
                    sample.cumulative_logprob += entry.logprob
            if out.finish_reason is not None:
                sample.finish_reason = out.finish_reason
                sample.stop_reason = out.stop_reason
            if stop_str is not None:
                if out.finish_reason is None:
                    to_abort.append(out.request_id)
                sample.finish_reason = "stop"
                sample.stop_reason = stop_str
            touched[parent_id] = parent
        results = [
            self._make_output(p, now)
            for p in touched.values()
            if not final_only or all(s.finished for s in p.samples.values())
        ]
        for res in results:
            if res.finished:
                self.abort_request(res.request_id)
        return results, to_abort

    def _make_output(self, parent: _ParentState, now: float) -> RequestOutput:
        outputs = []
        for sample in sorted(parent.samples.values(), key=lambda s: s.index):
            text = sample.detokenizer.output_text if sample.detokenizer is not None else ""
            outputs.append(
                CompletionOutput(
                    index=sample.index,
                    text=text,
                    token_ids=list(sample.token_ids),
                    cumulative_logprob=sample.cumulative_logprob,
                    logprobs=list(sample.logprobs) if sample.logprobs is not None else None,
                    finish_reason=sample.finish_reason,
                    stop_reason=sample.stop_reason,
                    text_offsets=_text_offsets(sample.detokenizer, len(text)),
                )
            )
        finished = all(s.finished for s in parent.samples.values())
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            num_cached_tokens=parent.num_cached_tokens,
            metrics=RequestMetrics(
                arrival_time=parent.arrival_time,
                first_token_time=parent.first_token_time,
                last_token_time=parent.last_token_time,
                finished_time=now if finished else None,
                first_scheduled_time=parent.first_scheduled_time,
            ),
            prompt_logprobs=parent.prompt_logprobs,
            embedding=parent.embedding,
            probs=parent.probs,
        )


def _text_offsets(detokenizer: Any, text_length: int) -> list[int] | None:
    offsets = detokenizer.token_offsets if detokenizer is not None else None
    return None if offsets is None else [min(o, text_length) for o in offsets]
