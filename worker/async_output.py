"""A step's sampled tokens between the sampler and the host: the model runner's side of async
scheduling (``EngineConfig.async_scheduling``; halserve.sched.async_steps is the scheduler's).

The sampler leaves step N's token ids on the device. Synchronously, the runner reads them at
once (``PendingOutput.resolve`` right after ``sample``). With async scheduling on the ``mp``
executor (a worker process, steps in order), step N's ids stay where they are::

    worker:  launch N ─ sample N ─ copy N → host (non-blocking) ─┐
             launch N+1: its placeholders ← N's ids, on the device │  (no device → host sync)
             resolve N: wait for N's copy, append the ids to the ◀─┘
                        host state, ModelRunnerOutput(N) → engine
             sample N+1 (penalties, seeds, min_tokens read the host state: N's ids are in)
    device:  N ──────────── N+1 ───────────── ...

``StepTokens`` maps request id -> row of step N's sampled-id tensor: step N+1's placeholder
inputs are gathered from it by request id (batch rows move between steps as requests join,
finish or are preempted).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from halserve.scheduler_output import ModelRunnerOutput
from halserve.spec_decode.verify import count_accepted

if TYPE_CHECKING:  # pragma: no cover
    from halserve.sampling.sampler import SamplerOutput
    from halserve.worker.runner_state import CachedRequestState, StepInputs


@dataclass(slots=True)
class StepTokens:
    """One step's sampled ids, still on the device, by request (what the next step's placeholders read)."""

    row_of_req: dict[str, int]  # request id -> its row in ``sampled`` (requests that sampled one token)
    sampled: torch.Tensor  # [S] int64 on the device

    def gather(self, req_ids: list[str]) -> torch.Tensor:
        """[P] the ids sampled for ``req_ids`` (on the device; no sync). A request that did not sample
        in that step is a bug of the scheduler's placeholders: AssertionError naming it."""
        missing = [r for r in req_ids if r not in self.row_of_req]
        if missing:
            raise AssertionError(f"requests {missing} have a placeholder input but sampled nothing in the step "
                                 f"before (it sampled for {sorted(self.row_of_req)})")
        rows = torch.tensor([self.row_of_req[r] for r in req_ids], dtype=torch.long)
        return self.sampled.index_select(0, rows.to(self.sampled.device, non_blocking=True))


@dataclass(slots=True)
class PendingOutput:
    """A sampled step whose token ids may still be on the device (or on their way to the host).
    ``resolve`` waits for them, appends them to the requests' host state and builds the step's
    ``ModelRunnerOutput``. Everything else of the output (logprobs, prompt logprobs, pooled
    results) is already on the host."""

    step: StepInputs
    rows: list[CachedRequestState]  # the sampling requests' states, in sample order
    drafts: list[list[int]]  # per sample row its drafts (speculative decoding; [] without)
    out: SamplerOutput | None  # None: nothing sampled this step
    prompt_logprobs: list
    pooled: list
    invalid_block_ids: set[int] | None = None
    # [2 or 3, L] int64 host copy of (sampled ids, has_token, min_tokens_waived); None: read the device
    host: torch.Tensor | None = None
    copied: object | None = None  # the device event recorded after the copy; None: nothing to wait for
    resolved: ModelRunnerOutput | None = field(default=None)

    def start_copy(self) -> None:
        """Queue the device -> host copy of the sampled ids (pinned memory, non-blocking) behind the
        sampler on the device's stream; on the CPU the tensors are the host copy already."""
        if self.out is None:
            return
        out = self.out
        parts = [out.sampled_token_ids, out.has_token.to(torch.long)]
        if out.min_tokens_waived is not None:
            parts.append(out.min_tokens_waived.to(torch.long))
        packed = torch.stack(parts)  # [2 or 3, L]
        if packed.device.type == "cpu":
            self.host = packed
            return
        self.host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
        self.host.copy_(packed, non_blocking=True)
        event = torch.Event(device=packed.device)
        event.record()
        self.copied = event

    def step_tokens(self) -> StepTokens | None:
        """The device ids by request, for the next step's placeholders (one token per request: no drafts)."""
        if self.out is None:
            return StepTokens({}, torch.empty(0, dtype=torch.long))
        if any(self.drafts):
            return None
        return StepTokens({s.req_id: i for i, s in enumerate(self.rows)}, self.out.sampled_token_ids)

    def resolve(self) -> ModelRunnerOutput:
        """The step's output, its token ids appended to the requests' host state (once)."""
        if self.resolved is not None:
            return self.resolved
        step = self.step
        num_reqs = len(step.states)
        sampled_token_ids: list[list[int]] = [[] for _ in range(num_reqs)]
        logprobs: list = [None] * num_reqs
        no_token_req_ids: set[str] = set()
        min_tokens_waived: set[str] = set()
        if self.out is not None:
            tokens, has_token, waived = self._host_lists()
            row = 0
            for r, state, draft in zip(step.sample_rows, self.rows, self.drafts):
                # accept drafts while the sampled token equals them (spec_decode/verify.py), then one more
                new_tokens, new_logprobs = [], []
                for j in range(len(draft) + 1):
                    if not has_token[row + j]:
                        no_token_req_ids.add(state.req_id)
                        break
                    new_tokens.append(tokens[row + j])
                    new_logprobs.append(self.out.logprobs[row + j])
                    if waived[row + j]:
                        min_tokens_waived.add(state.req_id)
                    if j == len(draft) or tokens[row + j] != draft[j]:
                        break
                row += len(draft) + 1
                state.output_token_ids.extend(new_tokens)
                sampled_token_ids[r] = new_tokens
                if new_logprobs and new_logprobs[0] is not None:
                    logprobs[r] = new_logprobs
                if draft:  # K/V of the rejected drafts is stale: not computed
                    step.seq_lens[r] -= len(draft) - count_accepted(draft, new_tokens)
            if any(self.drafts):  # (without drafts the runner set them when it sampled)
                for r, state in enumerate(step.states):
                    state.num_computed_tokens = int(step.seq_lens[r])
        self.resolved = ModelRunnerOutput(
            req_ids=step.req_ids, sampled_token_ids=sampled_token_ids, logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs, pooled=self.pooled, no_token_req_ids=no_token_req_ids,
            min_tokens_waived=min_tokens_waived)
        self.resolved.invalid_block_ids = self.invalid_block_ids
        self.out = None  # (drop the device tensors)
        return self.resolved

    def _host_lists(self) -> tuple[list[int], list[int], list[int]]:
        """(sampled ids, has_token, min_tokens_waived) as lists: a wait for the copy, or a device sync."""
        if self.host is None:
            self.start_copy()
        if self.copied is not None:
            self.copied.synchronize()
        packed = self.host.tolist()
        waived = packed[2] if len(packed) > 2 else [0] * len(packed[0])
        return packed[0], packed[1], waived


__all__ = ["PendingOutput", "StepTokens"]
