"""The model runner: turns a SchedulerOutput into one flattened forward pass and samples.

Per step (R scheduled requests, T tokens)::

    request r:  num_computed c_r (already in the KV cache), scheduled n_r new tokens
    input_ids       [T]     tokens c_r .. c_r+n_r-1 of each request, concatenated
    positions       [T]     c_r .. c_r+n_r-1
    query_start_loc [R+1]   cumsum of n_r
    seq_lens        [R]     c_r + n_r
    slot_mapping    [T]     block_table[r, pos // block_size] * block_size + pos % block_size
    logits_indices          last token of each request that reaches the end of its known
                            tokens this step (requests mid-prefill sample nothing); with
                            speculative decoding, its last token and each draft after it
    pool_indices            the same for pooling requests (embed, classify): they end with the
                            pooled result, never compute logits nor sample (a classifier has no LM head)
    prompt_indices          tokens whose logits score the next prompt token, for requests
                            that asked for prompt_logprobs (collected across their chunks)

Request state lives here between steps (the worker is stateful); the scheduler sends
full records only for new or resumed requests and diffs for the rest.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from halserve.attention_backends.base import kv_cache_torch_dtype
from halserve.kv_cache.spec import MLASpec, group_layers, group_size, is_recurrent
from halserve.scheduler_output import ModelRunnerOutput, SchedulerOutput
from halserve.spec_decode.verify import expand_rows
from halserve.structured_output.logits import apply_step_bitmask
from halserve.worker import mm_embeddings
from halserve.worker.async_output import PendingOutput, StepTokens
from halserve.worker.backend_selection import select_attention_backend
from halserve.worker.pooler import collect_pooled, pool_step
from halserve.worker.runner_state import CachedRequestState, StepInputs, update_states

if TYPE_CHECKING:  # pragma: no cover
    from halserve.config import EngineConfig
    from halserve.models.loader import ModelInfo
    from halserve.platforms.base import Platform

logger = logging.getLogger(__name__)


class ModelRunner:
    # Whether it pools (embed, classify). A runner that does not (XLA) samples a token for a pooling
    # request like for any other, which then ends without a result (the API reports that).
    supports_pooling: bool = True
    # Whether it checks draft tokens (speculative decoding: several logits rows per request).
    supports_speculative_decoding: bool = True
    # Whether it runs one pipeline stage (pipeline_parallel_size > 1).
    supports_pipeline_parallel: bool = True
    # Whether it feeds images to a vision-language model (halserve.multimodal).
    supports_multimodal: bool = True
    # Whether it runs a KV connector's loads and saves (kv_transfer_config; worker/kv_transfer.py).
    supports_kv_connector: bool = True
    # Whether it feeds each KV-cache group of a hybrid model (sliding-window and full layers) its own
    # block table (halserve.kv_cache.spec).
    supports_hybrid_kv_cache: bool = True

    def __init__(self, config: EngineConfig, platform: Platform, model_info: ModelInfo) -> None:
        self.config = config
        self.platform = platform
        self.info = model_info
        self.device = platform.device()
        self.block_size = config.block_size
        if config.speculative_config is not None and not self.supports_speculative_decoding:
            raise ValueError(f"the {type(self).__name__} of platform {platform.name!r} does not support speculative "
                             "decoding; drop speculative_config (--speculative-config) or use another platform")
        self.max_blocks_per_req = -(-model_info.max_model_len // config.block_size)
        from halserve.distributed import get_pp_state

        self.pp = get_pp_state()  # this rank's pipeline stage (one stage: first and last)
        if self.pp.size > 1 and not self.supports_pipeline_parallel:
            raise ValueError(f"the {type(self).__name__} of platform {platform.name!r} does not support pipeline "
                             "parallelism; use pipeline_parallel_size=1 (--pipeline-parallel-size)")
        if model_info.is_multimodal and not self.supports_multimodal:
            raise ValueError(f"the {type(self).__name__} of platform {platform.name!r} does not run vision-language "
                             f"models ({model_info.architecture}); use another platform")
        if model_info.is_multimodal and config.speculative_config is not None \
                and config.speculative_config.method == "draft_model":
            raise ValueError(f"a draft model cannot speculate for the vision-language model {model_info.architecture} "
                             "(it would read image placeholders as text); use method 'ngram' or no speculation")
        self.attn_backend_cls = select_attention_backend(config, platform, model_info)
        # a hybrid model's KV-cache groups (halserve.kv_cache.spec); None: one group of every layer
        from halserve.models.kv_cache_specs import model_kv_cache_specs

        self.kv_cache_specs = model_kv_cache_specs(model_info)
        groups = group_layers(list(self.kv_cache_specs)) if self.kv_cache_specs else []
        self.kv_cache_groups = groups if len(groups) > 1 else None
        self.num_kv_groups = len(groups) if self.kv_cache_groups else 1
        self.max_blocks_per_kv_groups = (sum(g.spec.max_num_blocks(model_info.max_model_len, config.block_size,
                                                                   config.max_num_batched_tokens) for g in groups)
                                         if groups else self.max_blocks_per_req)
        if self.kv_cache_groups is not None:
            self._check_hybrid(config)
        # an MLA model (DeepSeek-V2/V3) keeps one latent per position and layer, not per-head K/V
        self.mla_spec = next((s for s in self.kv_cache_specs if isinstance(s, MLASpec)), None)
        if self.mla_spec is not None:
            self._check_mla(config)
        self.model: torch.nn.Module | None = None
        self.kv_caches: list[torch.Tensor] = []
        self.requests: dict[str, CachedRequestState] = {}
        self.lora_manager = None  # a halserve.lora.manager.LoRAManager with enable_lora
        self.kv_connector = None  # the worker side of kv_transfer_config's connector
        self._step_connector = None  # it, while a step with loads or saves runs
        self.drafter = None  # a DraftModelProposer when speculative_config's method is "draft_model"
        self.step_graphs = None  # decode steps replayed from captured graphs (worker/step_graphs.py)
        # async scheduling (execute_model_deferred; worker/async_output.py): the last step's output, not yet
        # sent, and its sampled ids on the device by request (the next step's placeholder inputs)
        self._deferred: PendingOutput | ModelRunnerOutput | None = None
        self._prev_tokens: StepTokens | None = None
        self.num_placeholder_inputs = 0  # cumulative: input tokens gathered on the device from the step before
        spec = config.speculative_config
        if spec is not None and spec.method == "draft_model" and self.pp.is_last:  # (it needs the sampled tokens)
            from halserve.spec_decode.draft_model import DraftModelProposer

            self.drafter = DraftModelProposer(config, platform, model_info)
        # vision-language models (worker/mm_embeddings.py), chosen once for _forward: M-RoPE positions
        # (every stage: the rotary of each layer reads them) and image embeddings (the first stage)
        self._step_positions = mm_embeddings.step_positions if model_info.uses_mrope else _plain_positions
        self._model_kwargs = mm_embeddings.model_kwargs if model_info.is_multimodal and self.pp.is_first else _no_kwargs
        from halserve.layers.factory import layer_class, layer_overrides
        from halserve.sampling import Sampler

        self.sampler = layer_class(Sampler, layer_overrides(platform.name))()  # or the platform plugin's

    def _check_hybrid(self, config: EngineConfig) -> None:
        """What a hybrid KV cache (several groups over one pool) does not run with yet."""
        what = f"{self.info.architecture} has {len(self.kv_cache_groups)} KV-cache groups (sliding-window and full layers)"
        if not self.supports_hybrid_kv_cache:
            raise ValueError(f"{what}, which the {type(self).__name__} of platform {self.platform.name!r} does not "
                             "serve yet; use another platform")
        if self.pp.size > 1:
            raise ValueError(f"{what}: pipeline parallelism over a hybrid KV cache is not supported yet; use "
                             "pipeline_parallel_size=1")
        if config.kv_transfer_config is not None:
            raise ValueError(f"{what}: KV connectors move one block table per request; drop kv_transfer_config")
        spec = config.speculative_config
        if spec is not None and any(is_recurrent(g.spec) for g in self.kv_cache_groups):
            raise ValueError(f"{self.info.architecture} has recurrent (Mamba) layers, whose state cannot take back "
                             "rejected draft tokens; drop speculative_config")
        if spec is not None and spec.method == "draft_model":
            raise ValueError(f"{what}: a draft model shares one block table; use speculative method 'ngram' or none")

    def _check_mla(self, config: EngineConfig) -> None:
        """What an MLA latent cache does not run with yet (they move or share per-head K/V blocks)."""
        what = f"{self.info.architecture} keeps an MLA latent cache"
        if config.kv_transfer_config is not None:
            raise ValueError(f"{what}; KV connectors move per-head K/V blocks: drop kv_transfer_config")
        spec = config.speculative_config
        if spec is not None and spec.method == "draft_model":
            raise ValueError(f"{what}; a draft model shares its block tables: use speculative method 'ngram' or none")

    def _layer_cache_shape(self, num_blocks: int, num_kv_heads: int) -> tuple[int, ...]:
        """One attention layer's cache tensor: the backend's K/V layout, or an MLA model's latent pages."""
        if self.mla_spec is not None:
            return self.mla_spec.cache_shape(num_blocks, self.block_size)
        return self.attn_backend_cls.kv_cache_shape(num_blocks, self.block_size, num_kv_heads, self.info.head_size)

    # -- setup -----------------------------------------------------------------------
    def load_model(self) -> None:
        from halserve.models.loader import load_model

        start = time.perf_counter()
        self.model = load_model(self.config, self.info, self.platform, self.attn_backend_cls)
        logger.info(
            "loaded %s in %.1fs (attention backend: %s)",
            self.info.architecture,
            time.perf_counter() - start,
            self.attn_backend_cls.name,
        )
        if self.config.enable_lora:
            from halserve.lora.manager import LoRAManager

            self.lora_manager = LoRAManager(self.model, self.config, self.device, self.info.dtype)
        if self.drafter is not None:
            self.drafter.load_model()

    @property
    def kv_cache_dtype(self) -> torch.dtype:
        # (fp8: the device's e4m3 flavour, e4m3fnuz on MI300)
        return kv_cache_torch_dtype(self.config.kv_cache_dtype, self.info.dtype, self.platform.fp8_e4m3_dtype())

    def bytes_per_block(self) -> int:
        shape = self._layer_cache_shape(1, self._local_kv_heads())
        elem = torch.tensor([], dtype=self.kv_cache_dtype).element_size()
        draft = 0 if self.drafter is None else self.drafter.bytes_per_block(self.kv_cache_dtype)
        # a hybrid model's block holds one layer of each of its group_size tensors (kv_cache/spec.py)
        num_tensors = len(self.model.attention_layers) if self.kv_cache_groups is None else group_size(
            self.kv_cache_groups)
        return int(np.prod(shape)) * elem * num_tensors + draft

    def _local_kv_heads(self) -> int:
        layers = self.model.attention_layers if self.model is not None else []
        # (a hybrid model's first cached layer may be recurrent: a Mamba2 mixer keeps no heads)
        return next((layer.num_kv_heads for layer in layers if not is_recurrent(layer.kv_cache_spec)),
                    self.info.num_kv_heads)

    def determine_num_kv_blocks(self) -> int:
        """Blocks that fit the KV budget: ``kv_cache_memory`` bytes if set, else the
        platform's share of free memory; never more than the engine can ever use."""
        per_block = self.bytes_per_block()
        if self.config.kv_cache_memory is not None:
            budget = self.config.kv_cache_memory
        elif self.config.gpu_memory_utilization is not None:  # (vLLM's: a share of total memory)
            budget = self.platform.kv_cache_budget_of_total(self.config.gpu_memory_utilization)
        else:
            budget = self.platform.kv_cache_budget(self.config.kv_cache_memory_fraction)
        num_blocks = budget // per_block
        # +1: block 0 is the null block that pads block tables.
        useful = self.config.max_num_seqs * self.max_blocks_per_kv_groups + 1
        num_blocks = min(num_blocks, useful)
        if num_blocks < 2:
            raise ValueError(
                f"the KV cache budget of {budget} bytes holds {budget // per_block} blocks of "
                f"{per_block} bytes; at least 2 are needed. Raise kv_cache_memory or lower max_model_len/block_size"
            )
        return int(num_blocks)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.kv_caches = []
        if self.kv_cache_groups is not None:
            self._initialize_hybrid_kv_cache(num_blocks)
        for layer in self.model.attention_layers if self.kv_cache_groups is None else ():
            shape = self._layer_cache_shape(num_blocks, layer.num_kv_heads)
            cache = self.platform.allocate_kv_cache(shape, self.kv_cache_dtype)
            layer.kv_cache = cache
            self.kv_caches.append(cache)
        if self.drafter is not None:  # (the same block ids: it shares the block tables)
            self.drafter.initialize_kv_cache(num_blocks, self.kv_cache_dtype)
        from halserve.worker.kv_transfer import attach_connector

        self.kv_connector = attach_connector(self)
        logger.info("KV cache: %d blocks of %d tokens (%s)", num_blocks, self.block_size, self.kv_cache_dtype)

    def _initialize_hybrid_kv_cache(self, num_blocks: int) -> None:
        """One tensor per slot of a group (``group_size`` of them), shared by the groups: layer j of
        every group uses tensor j, and a block id is one group's at a time (kv_cache/spec.py)."""
        layers = self.model.attention_layers
        declared = list(self.kv_cache_specs)
        actual = [layer.kv_cache_spec for layer in layers]
        if actual != declared:
            raise ValueError(f"{self.info.architecture}'s attention layers keep {actual} in the KV cache but its config "
                             f"declares {declared} (models/kv_cache_specs.py); the model and its config disagree")
        kinds = self.attn_backend_cls.kv_cache_spec_kinds()
        for spec in dict.fromkeys(actual):
            if spec.kind not in kinds and not is_recurrent(spec):  # (a recurrent layer reads its pages itself)
                raise ValueError(f"attention backend {self.attn_backend_cls.name!r} cannot serve {spec.kind} layers "
                                 f"(it serves {', '.join(kinds)}); choose another attention_backend")
        shapes = {(layer.num_kv_heads, layer.head_size) for layer in layers if not is_recurrent(layer.kv_cache_spec)}
        if len(shapes) > 1:
            raise ValueError(f"{self.info.architecture}: the KV-cache groups share tensors, so every attention layer "
                             f"needs the same (kv heads, head size); its layers have {sorted(shapes)}")
        (num_kv_heads, head_size), = shapes
        shape = self.attn_backend_cls.kv_cache_shape(num_blocks, self.block_size, num_kv_heads, head_size)
        tensors = [self.platform.allocate_kv_cache(shape, self.kv_cache_dtype)
                   for _ in range(group_size(self.kv_cache_groups))]
        for g, group in enumerate(self.kv_cache_groups):
            for j, index in enumerate(group.layer_indices):
                layers[index].kv_cache = tensors[j]
                layers[index].kv_cache_group = g
                if is_recurrent(group.spec):  # its state goes into the pages of its slot's tensor (layers/mamba2.py)
                    layers[index].page_views = functools.partial(
                        self.attn_backend_cls.kv_cache_block_views, block_size=self.block_size,
                        num_kv_heads=num_kv_heads, head_size=head_size)
        self.kv_caches = [layer.kv_cache for layer in layers]  # (per layer, in order: aliases of the tensors)
        logger.info("hybrid KV cache: %d groups of up to %d layers (%s) over one pool", len(self.kv_cache_groups),
                    len(tensors), ", ".join(f"{g.spec.kind}{getattr(g.spec, 'window', '') or ''}"
                                            f"x{len(g.layer_indices)}" for g in self.kv_cache_groups))

    def warm_up(self) -> None:
        """One dummy forward of a full step (``max_num_batched_tokens`` tokens, attention
        skipped) and the logits of ``max_num_seqs`` rows, like vLLM's profile run: the GEMM
        library builds its kernels for the largest shapes and the allocator grows its heap
        here, not inside the first real step (measured: W1's first prefill step took 0.97 s
        instead of the 0.82 s of the ones after it)."""
        from halserve.forward_context import set_forward_context

        num_tokens = max(1, min(self.config.max_num_batched_tokens, self.config.max_num_seqs * self.info.max_model_len))
        with self.grad_mode():
            input_ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
            positions = torch.arange(num_tokens, device=self.device) % self.info.max_model_len
            with set_forward_context(None):
                hidden = self.model(input_ids, positions, self._intermediate_tensors(num_tokens, receive=False))
            if not self.pp.is_last:
                return
            head = self.model.classify if self.info.runner == "pooling" else self.model.compute_logits
            head(hidden[: min(num_tokens, self.config.max_num_seqs)])

    def capture_graphs(self) -> None:
        """After ``warm_up``: capture decode steps where the platform can (worker/step_graphs.py)."""
        from halserve.worker.step_graphs import StepGraphs

        if self.kv_cache_groups is not None:  # (its graphs would replay one block table for every group)
            logger.info("no step graphs: a hybrid KV cache has a block table per group; decode steps run eagerly")
            return
        self.step_graphs = StepGraphs.build(self)

    # -- per step --------------------------------------------------------------------
    # Gradient mode of a step; XLA cannot run under inference_mode, so its runner overrides.
    grad_mode = staticmethod(torch.inference_mode)

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput | None:
        """The step's output; None on a pipeline stage before the last (it sends its hidden states on)."""
        if self._deferred is not None:
            raise AssertionError("execute_model with a deferred step's output not taken (take_deferred_output)")
        self._prev_tokens = None  # (a synchronous step's tokens are on the host at once)
        with self.grad_mode():
            result = self._run_step(out)
            return result.resolve() if isinstance(result, PendingOutput) else result

    def execute_model_deferred(self, out: SchedulerOutput) -> tuple[bool, ModelRunnerOutput | None]:
        """Async scheduling (the ``mp`` worker's loop): launch this step and answer the step before.

        This step's inputs that are the step before's sampled tokens (placeholders) are gathered on
        the device from that step's ids; once this step's forward is launched, the step before's ids
        are read back (their non-blocking copy), appended to the host state, and its output is
        returned, while this step runs. Returns (whether a step was pending, its output); this
        step's output comes from the next call or ``take_deferred_output``."""
        assert self.pp.is_last and self.drafter is None, "async scheduling is refused with pipeline stages or drafts"
        with self.grad_mode():
            previous, self._deferred = self._deferred, None
            answer: list[ModelRunnerOutput] = []

            def resolve_previous() -> None:  # (before this step samples: penalties and seeds read the ids)
                if previous is not None and not answer:
                    answer.append(previous.resolve() if isinstance(previous, PendingOutput) else previous)

            result = self._run_step(out, before_sample=resolve_previous)
            resolve_previous()
            if isinstance(result, PendingOutput):
                result.start_copy()
                self._prev_tokens = result.step_tokens()
            self._deferred = result
            return previous is not None, answer[0] if answer else None

    def take_deferred_output(self) -> ModelRunnerOutput | None:
        """The deferred step's output (waiting for its ids), its tokens on the host; None when none is pending."""
        deferred, self._deferred = self._deferred, None
        return deferred.resolve() if isinstance(deferred, PendingOutput) else deferred

    def _run_step(self, out: SchedulerOutput, before_sample=None) -> PendingOutput | ModelRunnerOutput | None:
        """Update the request states, run the forward and launch the sampler: a ``PendingOutput`` whose
        ids may still be on the device; a ready output for an empty step (or a step that samples
        nothing); None before the last pipeline stage. ``before_sample`` runs once the forward is
        launched, before the sampler reads the host state."""
        update_states(self.requests, out, receives_tokens=not self.pp.is_last)
        if out.is_empty:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[], logprobs=[]) if self.pp.is_last else None
        step = self._prepare_inputs(out)
        if self.lora_manager is not None:
            self.lora_manager.set_batch([s.lora_request for s in step.states], step.common.query_start_loc_cpu)
        from halserve.worker import kv_transfer

        # The forward runs even when nothing samples (a prefill chunk): it writes the KV cache.
        self._step_connector = kv_transfer.start_step(self.kv_connector, out.kv_connector_metadata)
        try:
            logits = self._forward(step)
        finally:
            invalid_block_ids = kv_transfer.finish_step(self._step_connector)
            self._step_connector = None
        if not self.pp.is_last:
            for r, state in enumerate(step.states):
                state.num_computed_tokens = int(step.seq_lens[r])
            return None
        if before_sample is not None:
            before_sample()
        pending = self._sample(step, logits if step.sample_rows else None, out)
        pending.invalid_block_ids = invalid_block_ids
        if self.drafter is not None:  # the draft model proposes the next step's drafts (from the host ids)
            output = pending.resolve()
            self.drafter.propose_after_step(step, output, len(self.requests), self.info.max_model_len)
        return pending

    def _prepare_inputs(self, out: SchedulerOutput) -> StepInputs:
        """Host-side (numpy/CPU tensors) flattened inputs of one step."""
        from halserve.worker.step_inputs import prepare_inputs

        return prepare_inputs(out, self.requests, self.block_size, self.supports_pooling, self.num_kv_groups)

    def _forward(self, step: StepInputs) -> torch.Tensor | None:
        """Run the model on the step (writing its K/V); logits [len(sample_rows), vocab]
        float32, or None when no request samples this step. A pipeline stage runs its layers on
        what the stage before sent, and sends its output on (None before the last stage)."""
        dev = self.device
        c = step.common
        common = dataclasses.replace(
            c,
            query_start_loc=c.query_start_loc.to(dev, non_blocking=True),
            seq_lens=c.seq_lens.to(dev, non_blocking=True),
            block_table=c.block_table.to(dev, non_blocking=True),
            slot_mapping=c.slot_mapping.to(dev, non_blocking=True),
        )
        attn_metadata = self.attn_backend_cls.build_metadata(common)
        if step.group_common is not None:  # a hybrid model: one metadata per KV-cache group
            # (a recurrent group's layers read the host metadata: their state's block ids)
            attn_metadata = [attn_metadata] + [gc if is_recurrent(group.spec) else self.attn_backend_cls.build_metadata(
                dataclasses.replace(common, block_table=gc.block_table.to(dev, non_blocking=True),
                                    slot_mapping=gc.slot_mapping.to(dev, non_blocking=True)))
                for gc, group in zip(step.group_common, self.kv_cache_groups[1:])]
        from halserve.forward_context import set_forward_context

        input_ids = step.input_ids.to(dev, non_blocking=True)
        if step.placeholder_indices:  # async scheduling: the step before's sampled ids, gathered on the device
            input_ids = self._fill_placeholders(step, input_ids)
        positions = self._step_positions(step).to(dev, non_blocking=True)
        intermediate = self._intermediate_tensors(len(input_ids), receive=True)
        kwargs = self._model_kwargs(self.model, step, input_ids)
        hidden = None
        if self.step_graphs is not None:  # a decode-only step replays its captured graph (None: eager)
            hidden = self.step_graphs.replay(common, input_ids, positions, **kwargs)
        if hidden is None:
            decode_only = c.max_query_len == 1  # every request one token
            with set_forward_context(attn_metadata, self._step_connector, decode_only=decode_only):
                hidden = self.model(input_ids, positions, intermediate, **kwargs)
        if not self.pp.is_last:
            from halserve.distributed import pp_send

            pp_send(hidden)
            return None
        if self.drafter is not None:  # the draft's K/V for the same tokens and slots
            self.drafter.mirror(common, input_ids, positions)
        if step.prompt_indices:
            self._score_prompt(step, hidden)
        pool_step(step, hidden, self.model)  # pooling requests (embed, classify)
        if not step.sample_rows:
            return None
        from halserve.forward_context import set_argmax_rows

        with set_argmax_rows(lambda: self._argmax_rows(step)):  # (asked only by a head that can use it)
            return self.model.compute_logits(hidden.index_select(0, step.logits_indices.to(dev)))

    @staticmethod
    def _argmax_rows(step: StepInputs) -> list[bool] | None:
        """Per logits row of the step, whether only an argmax reads it (``sampling.takes_argmax_only``); None
        when none does or drafts are verified (their rows are the rejection sampler's)."""
        if step.sample_drafts and any(step.sample_drafts):
            return None
        from halserve.sampling import takes_argmax_only

        rows = [takes_argmax_only(state.sampling_params, len(state.output_token_ids))
                for state in (step.states[r] for r in step.sample_rows)]
        return rows if any(rows) else None

    def _intermediate_tensors(self, num_tokens: int, receive: bool):
        """What this pipeline stage gets from the one before: None on the first stage, else the
        previous stage's output (``receive``) or zeros of its shape (the warm-up)."""
        if self.pp.is_first:
            return None
        from halserve.models.pipeline import empty_intermediate_tensors

        tensors = empty_intermediate_tensors(num_tokens, self.info.hidden_size, self.info.dtype, self.device)
        if not receive:
            return {key: t.zero_() for key, t in tensors.items()}
        from halserve.distributed import pp_recv

        return pp_recv(tensors)

    def _score_prompt(self, step: StepInputs, hidden: torch.Tensor) -> None:
        """Logprobs of the prompt tokens this step's chunks cover, for requests that asked for
        prompt_logprobs; kept on their state until their first token."""
        from halserve.sampling.logprobs import score_tokens

        ks = [step.states[r].sampling_params.prompt_logprobs for r, count in step.prompt_spans for _ in range(count)]
        entries = score_tokens(self.model.compute_logits, hidden, step.prompt_indices, step.prompt_targets, ks)
        start = 0
        for r, count in step.prompt_spans:
            step.states[r].prompt_logprobs.extend(entries[start : start + count])
            start += count

    def _fill_placeholders(self, step: StepInputs, input_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids`` [T] (on the device) with each placeholder set to the id its request sampled in
        the step before, gathered there by request id: no device -> host sync."""
        if self._prev_tokens is None:
            raise AssertionError(f"requests {step.placeholder_req_ids} have placeholder inputs but the step before's "
                                 "ids are not on the device (only execute_model_deferred keeps them)")
        dst = torch.tensor(step.placeholder_indices, dtype=torch.long).to(input_ids.device, non_blocking=True)
        self.num_placeholder_inputs += len(dst)
        return input_ids.index_copy_(0, dst, self._prev_tokens.gather(step.placeholder_req_ids))

    def _sample(self, step: StepInputs, logits: torch.Tensor | None,
                scheduler_output: SchedulerOutput) -> PendingOutput:
        """Sample the step on the device; its ids stay there (``PendingOutput.resolve`` reads them). What
        does not need them is done here: prompt logprobs handed over, pooled results, computed counts."""
        num_reqs = len(step.states)
        prompt_logprobs: list = [None] * num_reqs
        pooled: list = [None] * num_reqs
        rows: list[CachedRequestState] = []
        drafts: list[list[int]] = []
        out = None
        if logits is not None:
            rows = [step.states[r] for r in step.sample_rows]
            drafts = step.sample_drafts or [[]] * len(rows)
            # one logits row per position that samples: a request's last token, then each draft
            row_states, row_outputs = expand_rows(rows, drafts)
            logits = apply_step_bitmask(logits, row_states, scheduler_output)  # structured outputs' masks
            out = self.sampler.sample(logits, self._sampling_metadata(row_states, row_outputs, logits.device))
            for r, state in zip(step.sample_rows, rows):
                if state.prompt_logprobs is not None:  # the prompt is all scored: send it with the first token
                    prompt_logprobs[r], state.prompt_logprobs = state.prompt_logprobs, None
        collect_pooled(step, pooled, prompt_logprobs)
        if not any(drafts):  # (with drafts, the rejected ones are not computed: known once the ids are read)
            for r, state in enumerate(step.states):
                state.num_computed_tokens = int(step.seq_lens[r])
        return PendingOutput(step=step, rows=rows, drafts=drafts, out=out, prompt_logprobs=prompt_logprobs,
                             pooled=pooled)

    def _sampling_metadata(self, rows: list[CachedRequestState], outputs: list[list[int]], device: torch.device):
        from halserve.sampling import SamplingMetadata

        return SamplingMetadata.build(
            params=[s.sampling_params for s in rows],
            prompt_token_ids=[s.prompt_token_ids for s in rows],
            output_token_ids=outputs,
            eos_token_ids=self.info.eos_token_ids,
            vocab_size=self.info.vocab_size,
            device=device,
        )


def _plain_positions(step: StepInputs) -> torch.Tensor:
    return step.positions  # [T]


def _no_kwargs(model: torch.nn.Module, step: StepInputs, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    return {}
