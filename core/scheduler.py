"""The engine core's scheduler: continuous batching with chunked prefill (vLLM V1 style).

Once per step the engine calls ``schedule()`` (what to compute), executes it on the
workers, and calls ``update_from_output()`` (what was sampled, who finished). It is built
from a ``SchedulerConfig``; each feature's rules (LoRA slots, grammars, pipeline stages,
speculative drafts, KV-connector loads, the image budget) live in ``halserve.sched`` and in
the feature's package, and the steps call them.
"""
from __future__ import annotations

import bisect
import itertools
import logging
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from halserve.engine_core_output import EngineCoreOutput
from halserve.kv_cache.manager import KVCacheManager
from halserve.lora.admission import LoRAAdmission
from halserve.multimodal.budget import fit_encoder_budget
from halserve.request import Request, RequestId, RequestStatus
from halserve.sched import (
    Admission,
    AdmissionPolicy,
    AsyncSteps,
    ConnectorLoads,
    DraftRule,
    GrammarGate,
    PipelineStages,
    PriorityWaitingQueue,
    SchedulerConfig,
    UnservedFeatures,
    make_spec_proposer,
)
from halserve.scheduler_output import CachedRequestData, ModelRunnerOutput, NewRequestData, SchedulerOutput
from halserve.structured_output import no_token_stop_reason

logger = logging.getLogger(__name__)

if TYPE_CHECKING:  # pragma: no cover
    from halserve.config import EngineConfig
    from halserve.kv_connectors.base import KVConnector
    from halserve.sched.drafts import Proposer
    from halserve.structured_output import StructuredOutputManager

__all__ = ["ITERATION_TOKENS_BUCKETS", "Scheduler", "SchedulerConfig", "SchedulerStats", "make_spec_proposer"]

# upper bounds (tokens) of the tokens-per-step histogram's buckets (vLLM's iteration_tokens_total), then +Inf
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass(slots=True)
class SchedulerStats:
    """A snapshot for logging and /metrics (``Scheduler.get_stats``)."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of usable blocks held by requests (every group's)
    prefix_cache_queries: int  # cumulative, tokens looked up at admission
    prefix_cache_hits: int  # cumulative, tokens found in the prefix cache
    num_preemptions: int  # cumulative
    kv_connector_hit_tokens: int = 0  # cumulative: tokens a KV connector loaded instead of computing
    spec_num_drafts: int = 0  # cumulative: decode steps that carried draft tokens
    spec_num_draft_tokens: int = 0  # cumulative: draft tokens checked by the model
    spec_num_accepted_tokens: int = 0  # cumulative: of which accepted
    # per KV-cache group (one for a plain model): fraction of usable blocks its tables hold
    kv_cache_group_usage: tuple[float, ...] = ()
    kv_cache_group_kinds: tuple[str, ...] = ()  # per KV-cache group: its spec's kind ("full_attention", ...)
    # cumulative: executed steps by tokens scheduled, one count per ITERATION_TOKENS_BUCKETS bound, then +Inf
    iteration_tokens_counts: tuple[int, ...] = ()
    iteration_tokens_sum: int = 0  # cumulative: tokens scheduled over all executed steps
    running_lora_adapters: tuple[str, ...] = ()  # names of the adapters of running requests (sorted)
    waiting_lora_adapters: tuple[str, ...] = ()  # names of the adapters of waiting requests (sorted)
    max_loras: int = 0  # most adapters in one batch (0: LoRA off)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        *,
        structured_outputs: StructuredOutputManager | None = None,
        spec_proposer: Proposer | None = None,
        kv_connector: KVConnector | None = None,
    ) -> None:
        """``structured_outputs`` compiles grammars (None: constrained requests refused);
        ``spec_proposer`` proposes draft tokens (None: no speculation); ``kv_connector`` is the
        scheduler side of ``kv_transfer_config`` (None: off)."""
        if kv_connector is not None and config.max_concurrent_batches > 1:
            raise ValueError("a KV connector cannot run with batches in flight (pipeline parallelism)")
        self.config = config
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = config.max_model_len
        self.block_size = config.block_size
        self.kv_cache_manager = KVCacheManager(config.num_blocks, config.block_size, max_model_len=config.max_model_len,
                                               enable_prefix_caching=config.enable_prefix_caching,
                                               layer_specs=config.kv_cache_specs)
        self._hybrid = self.kv_cache_manager.num_groups > 1  # (groups 1.. tables go to the worker too)
        self.requests: dict[RequestId, Request] = {}  # every unfinished request
        # scheduling_policy "priority": by (Request.priority, arrival), lower first (sched/priority.py)
        self._by_priority = config.scheduling_policy == "priority"
        self._blocked_id: RequestId | None = None  # (priority) the request step 2 last found short of blocks
        self.running: list[Request] = []  # kept in priority order, highest (lowest key) first
        # fcfs: the arrival rank; priority: (Request.priority, arrival rank). Lower runs first, preempted last
        self._priority: dict[RequestId, int | tuple[int, int]] = {}
        # FCFS: a deque, preempted requests go back to the front; priority: sorted by the key above
        self.waiting: deque[Request] | PriorityWaitingQueue = (
            PriorityWaitingQueue(lambda r: cast("tuple[int, int]", self._priority[r.request_id]))
            if self._by_priority else deque())
        self._arrivals = itertools.count()
        self._finished_req_ids: set[str] = set()  # for the next SchedulerOutput
        self.num_preemptions = 0  # cumulative
        self._iteration_tokens = [0] * (len(ITERATION_TOKENS_BUCKETS) + 1)  # steps per bucket (stats)
        self._iteration_tokens_sum = 0
        self.structured_outputs = structured_outputs
        self.kv_connector = kv_connector
        # the feature rules (halserve.sched); a feature that is off has none
        self.stages = PipelineStages(config.pipeline_parallel, config.max_concurrent_batches)
        self.grammars = None if structured_outputs is None else GrammarGate(structured_outputs)
        self.drafter = DraftRule(spec_proposer, config.max_model_len)
        self.kv_loads = None if kv_connector is None else ConnectorLoads(kv_connector, self.kv_cache_manager)
        self.async_steps = AsyncSteps() if config.async_scheduling else None  # (placeholders for steps in flight)
        lora = None if config.max_loras is None else LoRAAdmission(config.max_loras, max_overtakes=config.max_num_seqs)
        self.policies: list[AdmissionPolicy] = [
            p for p in (UnservedFeatures(has_structured_outputs=structured_outputs is not None, has_lora=lora is not None),
                        self.stages, self.grammars, lora) if p is not None]
        self._gates = [p for p in self.policies if p.gates_admission]  # (asked in schedule() step 2, in order)

    @classmethod
    def from_engine_config(cls, config: EngineConfig, *, num_blocks: int, max_model_len: int,
                           structured_outputs: StructuredOutputManager | None = None,
                           max_concurrent_batches: int = 1, kv_connector: KVConnector | None = None,
                           kv_cache_specs: tuple = ()) -> Scheduler:
        """``num_blocks`` comes from KV-cache sizing and ``max_model_len`` from the model
        (``config.max_model_len`` may still be None); ``max_concurrent_batches`` from the executor;
        ``kv_cache_specs`` (each attention layer's, ``ModelInfo.kv_cache_specs``) from the model."""
        sched_config = SchedulerConfig.from_engine_config(config, num_blocks=num_blocks, max_model_len=max_model_len,
                                                          max_concurrent_batches=max_concurrent_batches,
                                                          kv_cache_specs=kv_cache_specs)
        return cls(sched_config, structured_outputs=structured_outputs, spec_proposer=make_spec_proposer(config),
                   kv_connector=kv_connector)

    @property
    def spec_proposer(self) -> Proposer | None:
        return self.drafter.proposer

    @spec_proposer.setter
    def spec_proposer(self, proposer: Proposer | None) -> None:
        self.drafter.proposer = proposer

    @property
    def max_concurrent_batches(self) -> int:
        return self.stages.max_concurrent_batches

    # -- requests in ------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a new request. Rejects (ValueError) what could never be served."""
        req_id = request.request_id
        if req_id in self.requests:
            raise ValueError(f"request id {req_id!r} is already in use by an unfinished request; ids must be unique")
        prompt_len = request.num_prompt_tokens
        if prompt_len == 0:
            raise ValueError(f"request {req_id!r} has an empty prompt; give at least one prompt token")
        if prompt_len > self.max_model_len:
            raise ValueError(
                f"request {req_id!r}: the prompt has {prompt_len} tokens, longer than max_model_len="
                f"{self.max_model_len}; shorten the prompt or raise max_model_len"
            )
        if request.max_tokens < 1:
            raise ValueError(f"request {req_id!r}: max_tokens must be >= 1, got {request.max_tokens}")
        if request.priority != 0 and not self._by_priority:
            raise ValueError(
                f"priority={request.priority} (request {req_id!r}) needs priority scheduling, but this engine "
                f"schedules first come, first served (scheduling_policy 'fcfs'), which takes only priority 0; "
                "start it with --scheduling-policy priority (LLM(scheduling_policy='priority')), or leave priority out"
            )
        # Worst case it holds K/V for its whole length (capped by max_model_len); a request
        # that cannot fit in an otherwise empty cache would be preempted forever.
        num_tokens_needed = min(prompt_len + request.max_tokens, self.max_model_len)
        num_usable = self.kv_cache_manager.num_usable_blocks
        num_blocks_needed = self.kv_cache_manager.max_num_blocks(num_tokens_needed, self.max_num_batched_tokens)
        if num_blocks_needed > num_usable:
            raise ValueError(
                f"request {req_id!r} needs {num_tokens_needed} tokens of KV cache ({prompt_len} prompt + "
                f"max_tokens={request.max_tokens}) but the cache holds {num_usable * self.block_size} tokens "
                f"({num_usable} usable blocks of {self.block_size}; it needs {num_blocks_needed} over "
                f"{self.kv_cache_manager.num_groups} KV-cache group(s)); lower max_tokens or shorten the prompt, "
                "or raise num_kv_blocks / kv_cache_memory"
            )
        for policy in self.policies:  # (refusals first: UnservedFeatures leads the list)
            policy.on_added(request)
        request.status = RequestStatus.WAITING
        self.requests[req_id] = request
        self._priority[req_id] = ((request.priority, next(self._arrivals)) if self._by_priority
                                  else next(self._arrivals))
        self.waiting.append(request)

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> None:
        """End requests from outside the step loop: aborts, or a stop string matched by the
        detokenizer (``FINISHED_STOPPED``; set ``stop_reason`` on the request first if
        wanted). Unknown or already finished ids are ignored."""
        if not status.is_finished:
            raise ValueError(f"finish_requests needs a FINISHED_* status, got {status.name}")
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        for req_id in request_ids:
            request = self.requests.get(RequestId(req_id))
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._release(request)

    def abort_requests(self, request_ids: str | Iterable[str]) -> None:
        self.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    # -- one step ---------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Decide this step's batch.

        Algorithm (one token budget, ``max_num_batched_tokens``, per step):
        0. (``priority`` policy only) If the first waiting request the admission rules let in
           outranks running requests but lacks a seat or blocks, preempt (recompute) those of a
           strictly lower priority, the lowest and latest-arrived first (``_make_room``).
        1. Running requests, in priority order, each get what they still need (1 token for
           a decode, the rest of the prompt for an unfinished chunked prefill), cut to the
           remaining budget and to the step's image budget (``fit_encoder_budget``). A decode
           also carries the drafts ``self.drafter`` finds (speculative decoding; dropped
           first when blocks are short). When blocks run out, preempt by recompute the
           lowest-priority (latest-arrived) running request -- possibly the one being
           scheduled -- until the allocation succeeds. With batches in flight
           (``self.stages``), requests in an unreturned batch are skipped and never
           preempted, and a batch takes at most its share of the running requests.
        2. Unless step 1 preempted someone (memory is tight: let running requests drain),
           admit waiting requests in order (FCFS, or under the ``priority`` policy by (priority,
           arrival)) while budget, ``max_num_seqs`` and free blocks allow.
           Each admission rule (``self._gates``: grammar compiled, LoRA slots, not in flight)
           may pass a request over (SKIP: it keeps its place) or end admission (STOP). An
           admitted request starts after its longest prefix-cache hit plus what the KV
           connector loads (``self.kv_loads``), and gets a (possibly partial) prefill chunk.
           The first one that cannot get blocks stops admission (no overtaking), so large
           requests are not starved.
        3. Rules that add to the output: grammar masks, the KV connector's loads and saves.
        A request never waits forever: ``add_request`` guarantees each fits an empty cache,
        and the earliest running request can always preempt all the others (under ``priority``:
        a request waits while requests of a higher priority keep coming, as in vLLM).
        """
        kv = self.kv_cache_manager
        token_budget = self.max_num_batched_tokens
        num_scheduled_tokens: dict[str, int] = {}
        spec_tokens: dict[str, list[int]] = {}
        cached_reqs: list[CachedRequestData] = []
        new_reqs: list[NewRequestData] = []
        num_preempted = 0  # (by step 1: then no admissions this step)
        # (priority policy: room for a waiting request that outranks running ones)
        num_preempted_for_admission = self._make_room() if self._by_priority else 0
        encoder_left = self.max_num_batched_tokens  # image tokens the step may encode (multimodal/budget.py)
        drafter, stages, kv_loads, async_steps = self.drafter, self.stages, self.kv_loads, self.async_steps

        # 1. running requests
        in_flight = stages.in_flight
        share = stages.share(len(self.running))
        index = 0
        while index < len(self.running) and token_budget > 0 and len(cached_reqs) < share:
            request = self.running[index]
            if request.request_id in in_flight or (
                    async_steps is not None and not async_steps.can_schedule(request, self.max_model_len)):
                index += 1
                continue
            num_pending = (request.num_tokens - request.num_computed_tokens if async_steps is None
                           else async_steps.num_pending_tokens(request))
            num_new_tokens = min(num_pending, token_budget)
            assert num_new_tokens > 0, f"running request {request.request_id} has nothing to compute"
            num_new_tokens, encoder_used = fit_encoder_budget(request, request.num_computed_tokens, num_new_tokens,
                                                              encoder_left, self.max_num_batched_tokens, fresh=False)
            if not num_new_tokens:  # its next image waits for a step with room to encode it
                index += 1
                continue
            drafts = drafter.propose(request, token_budget, len(self.running))
            end = request.num_computed_tokens + num_new_tokens + len(drafts)
            lookahead = len(drafts) + drafter.lookahead(request, end)
            while (new_block_ids := kv.allocate_slots(request, num_new_tokens,
                                                      num_lookahead_tokens=lookahead)) is None:
                if lookahead:  # short of blocks: give up the drafts before preempting anyone
                    drafts, lookahead = [], 0
                    continue
                victim = self._pop_victim()
                self._preempt(victim)
                num_preempted += 1
                if victim is request:
                    break
            if new_block_ids is None:  # it preempted itself; it was the last running request
                break
            cached = CachedRequestData(request.request_id, new_block_ids, request.num_computed_tokens)
            if self._hybrid:
                cached.new_group_block_ids = kv.new_group_block_ids
            if stages.carries_tokens:
                stages.send_new_tokens(cached, request)
            cached_reqs.append(cached)
            if drafts:
                spec_tokens[request.request_id] = drafts
                num_new_tokens += len(drafts)
            num_scheduled_tokens[request.request_id] = num_new_tokens
            token_budget -= num_new_tokens
            encoder_left -= encoder_used
            index += 1

        # 2. waiting requests
        num_skipped = 0
        gates = self._gates
        for gate in gates:
            gate.begin_step(self.running)
        while (not num_preempted and len(self.waiting) > num_skipped and token_budget > 0
               and len(self.running) < self.max_num_seqs):
            request = self.waiting[num_skipped]
            verdict = Admission.ADMIT
            for gate in gates:
                if (verdict := gate.check(request)) is not Admission.ADMIT:
                    break
            if verdict is Admission.SKIP:
                num_skipped += 1
                continue
            if verdict is Admission.STOP:
                break
            computed_blocks, num_local = kv.get_computed_blocks(request)
            # (loaded into its blocks before the forward)
            num_external = 0 if kv_loads is None else kv_loads.external_hit(request, num_local)
            num_computed = num_local + num_external
            num_new_tokens = min(request.num_tokens - num_computed, token_budget)
            num_new_tokens, encoder_used = fit_encoder_budget(request, num_computed, num_new_tokens, encoder_left,
                                                              self.max_num_batched_tokens, fresh=True)
            if not num_new_tokens:  # (FCFS: no overtaking) its image waits for a step with room to encode it
                break
            if not self.config.enable_chunked_prefill and num_computed + num_new_tokens < request.num_tokens:
                break  # (chunked prefill off) the whole prompt waits for a step with room for all of it
            lookahead = drafter.lookahead(request, num_computed + num_new_tokens)
            num_slots = num_new_tokens + num_external
            new_block_ids = kv.allocate_slots(request, num_slots, computed_blocks, num_lookahead_tokens=lookahead)
            if new_block_ids is None and lookahead:  # the draft model proposes fewer instead
                new_block_ids = kv.allocate_slots(request, num_slots, computed_blocks)
            if new_block_ids is None:
                assert self.running, f"{request.request_id} does not fit an empty KV cache (add_request should refuse it)"
                if self._by_priority:  # (the next step preempts a lower priority for it: _make_room)
                    self._blocked_id = request.request_id
                break
            del self.waiting[num_skipped]
            for gate in gates:
                gate.on_admitted(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_computed
            if request.num_cached_tokens is None:
                request.num_cached_tokens = num_computed
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.time()
            if num_external and kv_loads is not None:
                kv_loads.on_admitted(request, num_local, num_external)
            bisect.insort(self.running, request, key=lambda r: self._priority[r.request_id])
            request.num_output_tokens_sent = request.num_output_tokens
            new_reqs.append(
                NewRequestData(
                    req_id=request.request_id,
                    prompt_token_ids=request.prompt_token_ids,
                    output_token_ids=list(request.output_token_ids),
                    sampling_params=request.sampling_params,
                    block_ids=kv.get_block_ids(request.request_id),
                    num_computed_tokens=num_computed,
                    lora_request=request.lora_request,
                    mm_features=request.mm_features,
                    mrope_positions=request.mrope_positions,
                    group_block_ids=kv.get_group_block_ids(request.request_id) if self._hybrid else None,
                )
            )
            num_scheduled_tokens[request.request_id] = num_new_tokens
            token_budget -= num_new_tokens
            encoder_left -= encoder_used

        # 3. the output
        finished_req_ids, self._finished_req_ids = self._finished_req_ids, set()
        stages.launched(num_scheduled_tokens, self.requests)
        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=num_scheduled_tokens,
            total_num_scheduled_tokens=self.max_num_batched_tokens - token_budget,
            finished_req_ids=finished_req_ids,
            num_preempted=num_preempted + num_preempted_for_admission,
            scheduled_spec_decode_tokens=spec_tokens,
        )
        if self.grammars is not None:
            self.grammars.fill_bitmask(output, self.requests)
        if kv_loads is not None:
            kv_loads.fill_metadata(output, self.requests)
        if async_steps is not None:
            async_steps.scheduled(output, self.requests)
        return output

    def _propose_drafts(self, request: Request, token_budget: int) -> list[int]:
        """The drafts ``request`` would carry if scheduled now (``DraftRule.propose``; ``schedule``
        calls the rule directly)."""
        return self.drafter.propose(request, token_budget, len(self.running))

    def _recover_failed_loads(self, block_ids: set[int]) -> None:
        """The workers could not load these blocks (the connector's copy was gone or broken): forget
        them as prefix-cache entries and recompute every running request that holds one, without
        the connector (their outputs of the step are dropped)."""
        assert self.kv_loads is not None, "the workers reported failed KV loads without a KV connector"
        victims = self.kv_loads.failed_load_victims(block_ids, self.running)
        for request in reversed(victims):  # (appendleft: they keep their order at the front of waiting)
            self.running.remove(request)
            request.kv_load_failed = True
            request.num_cached_tokens = None  # (what it finds when admitted again)
            self._preempt(request)
        self.kv_loads.failed_loads_recovered(block_ids, victims)

    def _pop_victim(self) -> Request:
        """Take the lowest-priority running request that is not in flight out of ``running`` (the
        running list is sorted by priority; the request being scheduled is never in flight)."""
        for j in range(len(self.running) - 1, -1, -1):
            if self.running[j].request_id not in self.stages.in_flight:
                return self.running.pop(j)
        raise AssertionError("every running request is in flight, including the one being scheduled")

    def _make_room(self) -> int:
        """(``priority`` policy, before step 1) Preempt, by recompute, running requests of a strictly
        lower priority than the first waiting request the admission rules let in now, latest-arrived of
        the lowest first, while it lacks a seat or the blocks of its first chunk (prefix hits not
        counted), and at least one when its admission failed for blocks last step (step 1 took them:
        each failed step costs a lower priority one more request, so it gets in). Returns how many."""
        waiting, running = self.waiting, self.running
        if not waiting or not running:
            return 0
        for gate in self._gates:
            gate.begin_step(running)
        for request in waiting:  # (in (priority, arrival) order)
            if request.priority >= running[-1].priority:
                return 0  # (running is sorted: it outranks nobody)
            verdict = Admission.ADMIT
            for gate in self._gates:
                if (verdict := gate.check(request)) is not Admission.ADMIT:
                    break
            if verdict is Admission.ADMIT:
                break
            if verdict is Admission.STOP:
                return 0
        else:
            return 0
        kv, budget = self.kv_cache_manager, self.max_num_batched_tokens
        num_blocks_needed = kv.max_num_blocks(min(request.num_tokens, budget), budget)
        blocked, self._blocked_id = self._blocked_id == request.request_id, None
        in_flight = self.stages.in_flight
        num_preempted = 0
        while blocked or len(running) >= self.max_num_seqs or kv.get_num_free_blocks() < num_blocks_needed:
            j = next((j for j in range(len(running) - 1, -1, -1) if running[j].request_id not in in_flight), None)
            if j is None or running[j].priority <= request.priority:
                break
            self._preempt(running.pop(j))
            num_preempted += 1
            blocked = False
        return num_preempted

    def unschedule_empty(self, scheduler_output: SchedulerOutput) -> None:
        """Take back an empty step that will not be executed (batches in flight): its finished
        request ids go with the next step instead."""
        assert scheduler_output.is_empty
        self._finished_req_ids |= scheduler_output.finished_req_ids

    @property
    def num_in_flight(self) -> int:
        """Requests in batches the engine has not had back yet."""
        return len(self.stages.in_flight)

    def wait_for_grammars(self, timeout: float) -> None:
        """Block until a waiting request's grammar compiles, at most ``timeout`` seconds (for an
        engine whose every unfinished request waits for one: ``schedule`` gave nothing)."""
        if self.grammars is not None:
            self.grammars.wait(self.waiting, timeout)

    def _preempt(self, request: Request) -> None:
        """Recompute preemption: drop its K/V, restart it from scratch later (its outputs
        are kept and re-fed). The worker learns through ``finished_req_ids`` of the step
        being built, and gets it again as ``NewRequestData`` when resumed."""
        self.kv_cache_manager.free(request)
        if self.kv_connector is not None:
            self.kv_connector.request_finished(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        if self.async_steps is not None:
            self.async_steps.preempted(request)
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        self._finished_req_ids.add(request.request_id)

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Apply one executed step: advance computed tokens, append sampled tokens, check
        stops, free finished requests. Returns one output per request that got a token or
        ended (one whose constraints left no token ends with none, as does a pooling request,
        which ends with its pooled result: vLLM's finish_reason "stop")."""
        if scheduler_output.total_num_scheduled_tokens:
            num = scheduler_output.total_num_scheduled_tokens
            self._iteration_tokens[bisect.bisect_left(ITERATION_TOKENS_BUCKETS, num)] += 1
            self._iteration_tokens_sum += num
        if model_runner_output.invalid_block_ids:
            self._recover_failed_loads(model_runner_output.invalid_block_ids)
        position = {req_id: i for i, req_id in enumerate(model_runner_output.req_ids)}
        logprobs = model_runner_output.logprobs
        outputs: list[EngineCoreOutput] = []
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        in_flight = self.stages.in_flight if self.stages.overlapping else None
        batch = None if self.async_steps is None else self.async_steps.returned()
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            request = self.requests.get(RequestId(req_id))
            if in_flight is not None and in_flight.pop(req_id, None) is not request:
                continue  # aborted while the step ran, and its id reused since
            if batch is not None:  # (async scheduling: num_computed_tokens advanced when scheduled)
                scheduled_request, samples = batch[req_id]
                if request is not scheduled_request or not samples or request.is_finished:
                    continue  # finished (or aborted) since, or a partial prefill chunk
                request.num_output_placeholders = max(0, request.num_output_placeholders - 1)  # (0: preempted)
            elif request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            preempted_meanwhile = request.status == RequestStatus.PREEMPTED  # (async scheduling: it waits)
            drafts = spec_tokens.get(req_id, ())
            if batch is None:
                # drafts are not the request's tokens until accepted (added below)
                request.num_computed_tokens += num_tokens - len(drafts)
                if request.num_computed_tokens < request.num_tokens:
                    continue  # a partial prefill chunk samples nothing (anything sampled is discarded)
            i = position.get(req_id)
            sampled = model_runner_output.sampled_token_ids[i] if i is not None else []
            pooled = model_runner_output.pooled
            new_token_ids: list[int] = []
            if i is not None and i < len(pooled) and pooled[i] is not None:  # a pooling request: its result ends it
                request.status = RequestStatus.FINISHED_STOPPED
            else:
                no_token = req_id in model_runner_output.no_token_req_ids  # its constraints left nothing (more)
                assert sampled or no_token, f"{req_id} completed its prefill/decode but the runner sampled no token"
                waive_min_tokens = req_id in model_runner_output.min_tokens_waived
                for token_id in sampled:
                    if request.grammar is not None and not request.grammar.follow(token_id, request.output_token_ids):
                        # (its mask allowed it: the grammar and the mask disagree)
                        request.status = RequestStatus.FINISHED_STOPPED
                        request.stop_reason = no_token_stop_reason(req_id, request.sampling_params, request.grammar,
                                                                   token_id)
                        break
                    request.append_output_token_id(token_id)
                    new_token_ids.append(token_id)
                    if request.check_stop(self.max_model_len, waive_min_tokens):
                        break
                if not request.is_finished and i is not None and i < len(model_runner_output.spec_token_ids):
                    request.spec_token_ids = model_runner_output.spec_token_ids[i]  # (for its next step)
                if no_token and not request.is_finished:
                    request.status = RequestStatus.FINISHED_STOPPED
                    request.stop_reason = no_token_stop_reason(req_id, request.sampling_params, request.grammar, None)
                if drafts:
                    # their K/V was written while checking them
                    request.num_computed_tokens += self.drafter.accept(drafts, sampled)
            sample_logprobs = logprobs[i] if i is not None and i < len(logprobs) and new_token_ids else None
            prompt_logprobs = model_runner_output.prompt_logprobs
            outputs.append(
                EngineCoreOutput(
                    request_id=req_id,
                    new_token_ids=new_token_ids,
                    new_logprobs=None if sample_logprobs is None else sample_logprobs[: len(new_token_ids)],
                    finish_reason=request.finish_reason,
                    stop_reason=request.stop_reason,
                    num_cached_tokens=request.num_cached_tokens or 0,
                    prompt_logprobs=prompt_logprobs[i] if i is not None and i < len(prompt_logprobs) else None,
                    pooled=pooled[i] if i is not None and i < len(pooled) else None,
                    # (once: with the first output, which carries every output token so far)
                    scheduled_time=(request.first_scheduled_time
                                    if request.num_output_tokens <= len(new_token_ids) else None),
                )
            )
            if request.is_finished:
                (self.waiting if preempted_meanwhile else self.running).remove(request)
                self._release(request)
        return outputs

    def _release(self, request: Request) -> None:
        """Forget a finished request (already out of running/waiting) and free its blocks."""
        self.kv_cache_manager.free(request)
        if self.kv_connector is not None:
            self.kv_connector.request_finished(request)
        del self.requests[request.request_id]
        del self._priority[request.request_id]
        self._finished_req_ids.add(request.request_id)
        self.drafter.on_finished(request)
        for policy in self.policies:
            policy.on_finished(request)

    # -- queries and stats ------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def get_request(self, request_id: str) -> Request | None:
        return self.requests.get(RequestId(request_id))

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def kv_cache_usage(self) -> float:
        return self.kv_cache_manager.usage

    @property
    def kv_cache_group_usage(self) -> tuple[float, ...]:
        """Per KV-cache group, the fraction of the pool's usable blocks its requests hold (they sum
        to ``kv_cache_usage``; O(blocks held): for stats, not the step loop)."""
        kv = self.kv_cache_manager
        if kv.num_groups == 1:
            return (kv.usage,)
        return tuple(n / kv.num_usable_blocks for n in kv.num_blocks_by_group())

    @property
    def prefix_cache_queries(self) -> int:
        return self.kv_cache_manager.prefix_cache_queries

    @property
    def prefix_cache_hits(self) -> int:
        return self.kv_cache_manager.prefix_cache_hits

    def get_stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=self.num_running,
            num_waiting=self.num_waiting,
            kv_cache_usage=self.kv_cache_usage,
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
            kv_connector_hit_tokens=0 if self.kv_loads is None else self.kv_loads.num_hit_tokens,
            spec_num_drafts=self.drafter.num_drafts,
            spec_num_draft_tokens=self.drafter.num_draft_tokens,
            spec_num_accepted_tokens=self.drafter.num_accepted_tokens,
            kv_cache_group_usage=self.kv_cache_group_usage,
            kv_cache_group_kinds=tuple(spec.kind for spec in self.kv_cache_manager.specs),
            iteration_tokens_counts=tuple(self._iteration_tokens),
            iteration_tokens_sum=self._iteration_tokens_sum,
            running_lora_adapters=_lora_names(self.running),
            waiting_lora_adapters=_lora_names(self.waiting),
            max_loras=self.config.max_loras or 0,
        )

    def reset_prefix_cache(self) -> bool:
        """Forget all cached prefixes; only possible (True) when no request holds blocks."""
        return self.kv_cache_manager.reset_prefix_cache()


def _lora_names(requests: Iterable[Request]) -> tuple[str, ...]:
    return tuple(sorted({r.lora_request.lora_name for r in requests if r.lora_request is not None}))
