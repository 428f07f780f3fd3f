"""The scheduler with a KV connector, no model: ``StoreWorker`` plays the workers. It keeps a paged
K/V store of token ids (slot -> the token whose K/V is there), applies the connector's loads
before the "forward" and its saves after it, and checks that every position a request attends to
holds the right token, so a load into the wrong block, a missing load or a wrong hit fails."""
from __future__ import annotations

import pytest
from scheduler_helpers import make_request

from halserve.kv_connectors.base import ConnectorContext, KVTransferConfig, Role
from halserve.kv_connectors.block_store import BlockStoreConnector
from halserve.request import RequestStatus
from halserve.scheduler import Scheduler, SchedulerConfig
from halserve.scheduler_output import ModelRunnerOutput

BS = 4


class MemoryConnector(BlockStoreConnector):
    """A store in a dict (key -> the block's token ids), shared by both roles."""

    name = "Memory"

    def __init__(self, store: dict, role: str = "kv_both") -> None:
        super().__init__(KVTransferConfig(kv_connector="Memory", kv_role=role), Role.SCHEDULER,
                         ConnectorContext(config=None, model_id="m", block_size=BS, world_size=1))
        self.store = store

    def count_present(self, keys):
        n = 0
        while n < len(keys) and keys[n] in self.store:
            n += 1
        return n

    def missing(self, keys):
        return [key not in self.store for key in keys]


class StoreWorker:
    def __init__(self, connector: MemoryConnector, broken: set[str] = frozenset()) -> None:
        self.connector = connector
        self.broken = broken  # keys whose loads fail
        self.reqs: dict[str, dict] = {}
        self.kv: dict[int, int] = {}
        self.loaded: list[str] = []
        self.saved: list[str] = []

    def slot(self, st, pos):
        return st["blocks"][pos // BS] * BS + pos % BS

    def execute(self, so) -> ModelRunnerOutput:
        for req_id in so.finished_req_ids:
            self.reqs.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            self.reqs[new.req_id] = {"tokens": [*new.prompt_token_ids, *new.output_token_ids],
                                     "computed": new.num_computed_tokens, "blocks": list(new.block_ids)}
        for cached in so.scheduled_cached_reqs:
            self.reqs[cached.req_id]["blocks"] += cached.new_block_ids
        meta = so.kv_connector_metadata
        failed = set()
        for load in meta.loads:  # before the forward
            self.loaded.append(load.key)
            if load.key in self.broken:
                failed.add(load.block_id)
                continue
            for i, token in enumerate(self.connector.store[load.key]):
                self.kv[load.block_id * BS + i] = token
        req_ids, sampled = [], []
        for req_id, n in so.num_scheduled_tokens.items():
            st = self.reqs[req_id]
            for pos in range(st["computed"], st["computed"] + n):
                self.kv[self.slot(st, pos)] = st["tokens"][pos]
        for req_id, n in so.num_scheduled_tokens.items():
            st = self.reqs[req_id]
            st["computed"] += n
            context = [self.kv.get(self.slot(st, p)) for p in range(st["computed"])]
            touches_failed = any(b in failed for b in st["blocks"])
            assert touches_failed or context == st["tokens"][: st["computed"]], f"{req_id} attends to wrong K/V"
            req_ids.append(req_id)
            if st["computed"] == len(st["tokens"]):
                token = 100 + (sum(st["tokens"]) * 7 + len(st["tokens"])) % 50
                st["tokens"].append(token)
                sampled.append([token])
            else:
                sampled.append([])
        for save in meta.saves:  # after the forward
            self.saved.append(save.key)
            self.connector.store[save.key] = [self.kv[save.block_id * BS + i] for i in range(BS)]
        return ModelRunnerOutput(req_ids, sampled, [None] * len(req_ids), invalid_block_ids=failed)


def make_scheduler(connector, num_blocks=64, prefix=True, budget=64):
    return Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=128, block_size=BS,
                                     num_blocks=num_blocks, enable_prefix_caching=prefix), kv_connector=connector)


def run(sched, worker, requests, max_steps=200):
    for request in requests:
        sched.add_request(request)
    tokens: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return tokens
        so = sched.schedule()
        for out in sched.update_from_output(so, worker.execute(so)):
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    raise AssertionError("did not finish")


PROMPT = list(range(1, 19))  # 18 tokens: 4 full blocks and 2 more


def test_producer_saves_each_full_block_once_and_a_second_engine_loads_them():
    store: dict = {}
    first = StoreWorker(MemoryConnector(store))
    expected = run(make_scheduler(first.connector), first, [make_request("a", PROMPT, max_tokens=6)])
    # 18 + 5 computed tokens -> 5 full blocks, each saved once, after its step
    assert len(first.saved) == len(set(first.saved)) == 5 and set(first.saved) == set(store)
    assert first.loaded == []

    second = StoreWorker(MemoryConnector(store))  # a fresh engine: empty KV cache, same store
    sched = make_scheduler(second.connector)
    request = make_request("b", PROMPT, max_tokens=6)
    sched.add_request(request)
    so = sched.schedule()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 16  # 4 blocks loaded: never the last token's block
    assert so.num_scheduled_tokens["b"] == 2
    assert [t.block_id for t in so.kv_connector_metadata.loads] == so.scheduled_new_reqs[0].block_ids[:4]
    tokens = [t for out in sched.update_from_output(so, second.execute(so)) for t in out.new_token_ids]
    while sched.has_unfinished_requests():
        so = sched.schedule()
        tokens += [t for out in sched.update_from_output(so, second.execute(so)) for t in out.new_token_ids]
    assert tokens == expected["a"]
    assert request.num_cached_tokens == 16 and sched.get_stats().kv_connector_hit_tokens == 16
    assert second.saved == []  # (the 5th block was already in the store)


def test_local_prefix_hit_comes_first_then_the_connector_continues():
    store: dict = {}
    worker = StoreWorker(MemoryConnector(store))
    sched = make_scheduler(worker.connector)
    run(sched, worker, [make_request("a", PROMPT[:9], max_tokens=1)])  # blocks 0, 1 local and stored
    # another engine stored the longer prompt's blocks 2 and 3
    other = StoreWorker(MemoryConnector(store))
    run(make_scheduler(other.connector), other, [make_request("x", PROMPT, max_tokens=1)])
    worker.loaded.clear()
    request = make_request("b", PROMPT, max_tokens=2)
    sched.add_request(request)
    so = sched.schedule()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 16
    assert sched.kv_cache_manager.prefix_cache_hits == 8  # blocks 0, 1 from the local cache ...
    assert len(so.kv_connector_metadata.loads) == 2  # ... blocks 2, 3 loaded
    sched.update_from_output(so, worker.execute(so))
    assert worker.loaded == [load.key for load in so.kv_connector_metadata.loads]


@pytest.mark.parametrize("role, loads, saves", [("kv_producer", False, True), ("kv_consumer", True, False)])
def test_roles(role, loads, saves):
    store: dict = {}
    seed = StoreWorker(MemoryConnector(store))
    run(make_scheduler(seed.connector), seed, [make_request("s", PROMPT[:9], max_tokens=1)])
    worker = StoreWorker(MemoryConnector(store, role))
    run(make_scheduler(worker.connector), worker, [make_request("a", PROMPT, max_tokens=3)])
    assert bool(worker.loaded) == loads
    assert bool(worker.saved) == saves


def test_prompt_logprobs_requests_compute_their_whole_prompt():
    store: dict = {}
    seed = StoreWorker(MemoryConnector(store))
    run(make_scheduler(seed.connector), seed, [make_request("s", PROMPT, max_tokens=1)])
    worker = StoreWorker(MemoryConnector(store))
    sched = make_scheduler(worker.connector)
    sched.add_request(make_request("a", PROMPT, max_tokens=1, prompt_logprobs=1))
    so = sched.schedule()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 0 and not so.kv_connector_metadata.loads


def test_connector_works_without_local_prefix_caching():
    store: dict = {}
    seed = StoreWorker(MemoryConnector(store))
    expected = run(make_scheduler(seed.connector, prefix=False), seed, [make_request("a", PROMPT, max_tokens=4)])
    worker = StoreWorker(MemoryConnector(store))
    sched = make_scheduler(worker.connector, prefix=False)
    assert run(sched, worker, [make_request("a", PROMPT, max_tokens=4)]) == expected
    assert sched.get_stats().kv_connector_hit_tokens == 16


def test_failed_loads_recompute_the_requests_holding_those_blocks():
    store: dict = {}
    seed = StoreWorker(MemoryConnector(store))
    expected = run(make_scheduler(seed.connector), seed, [make_request("a", PROMPT, max_tokens=5)])
    bad_key = seed.saved[2]  # the third block's copy is broken
    worker = StoreWorker(MemoryConnector(store), broken={bad_key})
    sched = make_scheduler(worker.connector)
    # "b" loads the broken block; "c" shares the prompt and hits b's blocks locally in the same step
    requests = [make_request("b", PROMPT, max_tokens=5), make_request("c", PROMPT, max_tokens=5)]
    for request in requests:
        sched.add_request(request)
    so = sched.schedule()
    assert {t.key for t in so.kv_connector_metadata.loads} >= {bad_key}
    outputs = sched.update_from_output(so, worker.execute(so))
    assert outputs == []  # both dropped their step's tokens ...
    assert all(r.status == RequestStatus.PREEMPTED and r.kv_load_failed for r in requests)
    assert [r.request_id for r in sched.waiting] == ["b", "c"]  # ... and wait in their order
    assert sched.kv_cache_manager.block_pool.get_cached_block(requests[0].block_hashes[2]) is None
    tokens: dict[str, list[int]] = {}
    while sched.has_unfinished_requests():
        so = sched.schedule()
        assert bad_key not in {t.key for t in so.kv_connector_metadata.loads}
        for out in sched.update_from_output(so, worker.execute(so)):
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert tokens == {"b": expected["a"], "c": expected["a"]}


def test_finished_and_preempted_requests_are_forgotten():
    store: dict = {}
    worker = StoreWorker(MemoryConnector(store))
    sched = make_scheduler(worker.connector, num_blocks=8, budget=32)  # 7 usable blocks: preemptions
    prompts = [[(7 * i + j) % 90 + 1 for j in range(10)] for i in range(3)]
    run(sched, worker, [make_request(str(i), p, max_tokens=12) for i, p in enumerate(prompts)])
    assert sched.num_preemptions > 0
    assert worker.connector._num_handled == {} and worker.connector._block_ids == {}
