"""Draft-model speculative decoding, worker side: a small model of the target's vocabulary
proposes the next step's drafts, greedily, right after the target's step.

Its KV cache has the target's block ids and slots (same ``num_blocks``, same block tables),
so the prefix cache, preemption and block allocation need nothing of their own. Per step::

    1. mirror:  the draft runs on the step's own inputs (prompt chunks, last tokens and the
                drafts being checked), writing its K/V where the target wrote its own
                (rejected drafts leave stale K/V past the accepted tokens, as in the target:
                never attended, overwritten by the next step)
    2. propose: for each request that got tokens, from its new last token at position P,
                k decode forwards: feed t_j at P + j, take the argmax as draft j, feed it next

The scheduler allocates k lookahead slots after each step's tokens for step 2
(``Scheduler.num_draft_lookahead_tokens``); a request with fewer slots (blocks were short, or
near max_model_len) gets fewer drafts.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

import numpy as np
import torch

from halserve.attention_backends.base import AttentionMetadata
from halserve.forward_context import set_forward_context

if TYPE_CHECKING:  # pragma: no cover
    from halserve.config import EngineConfig
    from halserve.models.loader import ModelInfo
    from halserve.platforms.base import Platform
    from halserve.scheduler_output import ModelRunnerOutput
    from halserve.worker.runner_state import CachedRequestState, StepInputs

logger = logging.getLogger(__name__)


class WorkerDrafts:
    """The scheduler's side of draft-model speculation: the drafts come from the workers
    (``ModelRunnerOutput.spec_token_ids``, kept on the request for its next step), and each
    request that samples gets ``num_speculative_tokens`` lookahead slots for the draft model."""

    from_worker = True

    def __init__(self, num_speculative_tokens: int, disable_by_batch_size: int | None = None) -> None:
        self.num_speculative_tokens = num_speculative_tokens
        self.disable_by_batch_size = disable_by_batch_size

    def forget(self, key: str) -> None:
        """(Nothing kept per request on the scheduler's side.)"""


class DraftModelProposer:
    """Owned by the model runner when ``speculative_config.method`` is "draft_model"."""

    def __init__(self, config: EngineConfig, platform: Platform, target_info: ModelInfo) -> None:
        from halserve.models.loader import get_model_info
        from halserve.worker.backend_selection import select_attention_backend

        spec = config.speculative_config
        assert spec is not None and spec.method == "draft_model"
        self.num_speculative_tokens = spec.num_speculative_tokens
        self.disable_by_batch_size = spec.disable_by_batch_size
        self.platform = platform
        self.device = platform.device()
        self.block_size = config.block_size
        self.config = config.model_copy(update=dict(
            model=spec.model, revision=spec.revision, tokenizer=None, quantization=None, enable_lora=False,
            dtype=str(target_info.dtype).removeprefix("torch."), max_model_len=target_info.max_model_len,
            pooler_config=None, speculative_config=None, pipeline_parallel_size=1,
        ))
        try:
            self.info = get_model_info(self.config, platform)
        except ValueError as exc:
            raise ValueError(f"speculative_config draft model {spec.model!r}: {exc}") from None
        if self.info.runner != "generate":
            raise ValueError(f"speculative_config draft model {spec.model!r} is a {self.info.architecture}, which has "
                             "no LM head to propose tokens; use a causal LM of the target's vocabulary")
        # Sizes may differ by padding (Qwen2.5-0.5B has 151936 rows, Qwen2.5-7B 152064): drafts are
        # taken among the ids both have. A draft of another tokenizer is not an error (every draft
        # is checked), only useless: nothing is accepted.
        self.target_vocab_size = target_info.vocab_size
        self.num_shared_ids = min(self.info.vocab_size, target_info.vocab_size)
        if self.info.vocab_size != target_info.vocab_size:
            logger.warning("draft model %s has %d vocabulary rows, the target %d: drafts are taken among the first "
                           "%d ids; the two must share a tokenizer for drafts to be accepted", spec.model,
                           self.info.vocab_size, target_info.vocab_size, self.num_shared_ids)
        self.attn_backend_cls = select_attention_backend(self.config, platform, self.info)
        self.model: torch.nn.Module | None = None
        self.kv_caches: list[torch.Tensor] = []

    # -- setup (the runner calls these next to its own) ------------------------------------
    def load_model(self) -> None:
        from halserve.distributed import whole_model_stage
        from halserve.models.loader import load_model

        with whole_model_stage():  # (pipeline parallelism: it runs whole, on the last stage)
            self.model = load_model(self.config, self.info, self.platform, self.attn_backend_cls, progress=False)
        logger.info("loaded draft model %s (%s, attention backend %s)", self.info.model_path,
                    self.info.architecture, self.attn_backend_cls.name)

    def bytes_per_block(self, kv_cache_dtype: torch.dtype) -> int:
        layers = self.model.attention_layers
        shape = self.attn_backend_cls.kv_cache_shape(1, self.block_size, layers[0].num_kv_heads, self.info.head_size)
        elem = torch.tensor([], dtype=kv_cache_dtype).element_size()
        return int(np.prod(shape)) * elem * len(layers)

    def initialize_kv_cache(self, num_blocks: int, kv_cache_dtype: torch.dtype) -> None:
        self.kv_caches = []
        for layer in self.model.attention_layers:
            shape = self.attn_backend_cls.kv_cache_shape(num_blocks, self.block_size, layer.num_kv_heads,
                                                         self.info.head_size)
            layer.kv_cache = self.platform.allocate_kv_cache(shape, kv_cache_dtype)
            self.kv_caches.append(layer.kv_cache)

    # -- per step --------------------------------------------------------------------------
    def mirror(self, common: AttentionMetadata, input_ids: torch.Tensor, positions: torch.Tensor) -> None:
        """Step 1: the target step's inputs (device tensors) through the draft, for its K/V."""
        with set_forward_context(self.attn_backend_cls.build_metadata(common)):
            self.model(self._embeddable(input_ids), positions)

    def propose(self, states: list[CachedRequestState], max_model_len: int) -> list[list[int]]:
        """Step 2: up to k drafts after each request's last token (its state is up to date)."""
        k, bs = self.num_speculative_tokens, self.block_size
        last = np.array([s.num_tokens - 1 for s in states], dtype=np.int64)  # P per request
        room = np.array([min(len(s.block_ids) * bs, max_model_len) for s in states], dtype=np.int64) - last
        counts = np.clip(room, 0, k)  # drafts each request can take
        drafts: list[list[int]] = [[] for _ in states]
        tokens = [s.output_token_ids[-1] if s.output_token_ids else s.prompt_token_ids[-1] for s in states]
        for j in range(int(counts.max(initial=0))):
            rows = np.flatnonzero(counts > j)
            positions = last[rows] + j
            max_blocks = int(positions.max()) // bs + 1
            block_table = np.zeros((len(rows), max_blocks), dtype=np.int32)
            for i, r in enumerate(rows):
                ids = states[r].block_ids[:max_blocks]
                block_table[i, : len(ids)] = ids
            slots = block_table[np.arange(len(rows)), positions // bs].astype(np.int64) * bs + positions % bs
            qsl = torch.arange(len(rows) + 1, dtype=torch.int32)
            seq_lens = torch.from_numpy((positions + 1).astype(np.int32))
            common = AttentionMetadata(
                num_actual_tokens=len(rows), num_reqs=len(rows), max_query_len=1, max_seq_len=int(positions.max()) + 1,
                query_start_loc=qsl, seq_lens=seq_lens, block_table=torch.from_numpy(block_table),
                slot_mapping=torch.from_numpy(slots), query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens,
            )
            dev = self.device
            common = dataclasses.replace(
                common, query_start_loc=qsl.to(dev), seq_lens=seq_lens.to(dev),
                block_table=common.block_table.to(dev), slot_mapping=common.slot_mapping.to(dev),
            )
            input_ids = torch.tensor([tokens[r] for r in rows], dtype=torch.long, device=dev)
            with set_forward_context(self.attn_backend_cls.build_metadata(common)):
                hidden = self.model(self._embeddable(input_ids), torch.from_numpy(positions).to(dev))
            proposals = self.model.compute_logits(hidden)[:, : self.num_shared_ids].argmax(dim=-1).tolist()
            for r, token in zip(rows, proposals):
                drafts[r].append(token)
                tokens[r] = token
        return drafts

    def propose_after_step(self, step: StepInputs, output: ModelRunnerOutput, num_requests: int,
                           max_model_len: int) -> None:
        """The runner's call after a target step: drafts for the requests that sampled a token, into
        ``output.spec_token_ids`` (by batch row). None while ``disable_by_batch_size`` or more requests
        run (``num_requests``): the scheduler would drop them (the K/V is still written, by ``mirror``)."""
        limit = self.disable_by_batch_size
        if limit is not None and num_requests >= limit:
            return
        rows = [r for r in step.sample_rows if output.sampled_token_ids[r]]
        drafts = self.propose([step.states[r] for r in rows], max_model_len)
        output.spec_token_ids = [[] for _ in step.req_ids]
        for r, proposal in zip(rows, drafts):
            output.spec_token_ids[r] = proposal

    def _embeddable(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Ids past a smaller draft vocabulary (a target-only token) become its last id: the
        draft only guesses worse there, and every draft is checked anyway."""
        if self.info.vocab_size < self.target_vocab_size:
            return input_ids.clamp(max=self.info.vocab_size - 1)
        return input_ids
