"""Pipeline parallelism, the scheduler's part: the stages before the last never sample, so each
scheduled cached request carries the output tokens sampled since the workers last heard of it
(``CachedRequestData.new_token_ids``). A non-sampling stage that keeps its request state only
from those diffs must know every token it is asked to compute, through chunked prefill,
preemption and resumption, and prefix-cache hits."""
import random

from scheduler_helpers import make_request

from halserve.scheduler import Scheduler, SchedulerConfig

BS = 4


class NonSamplingStage:
    """Keeps each request's tokens from the SchedulerOutput alone, as a first stage's runner does."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}

    def apply(self, so) -> None:
        for req_id in so.finished_req_ids:
            self.tokens.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            self.tokens[new.req_id] = [*new.prompt_token_ids, *new.output_token_ids]
        for cached in so.scheduled_cached_reqs:
            self.tokens[cached.req_id].extend(cached.new_token_ids)


def test_a_non_sampling_stage_knows_every_token_it_computes():
    from halserve.scheduler_output import ModelRunnerOutput

    sched = Scheduler(SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=24, max_model_len=128, block_size=BS,
                                      num_blocks=20, pipeline_parallel=True))
    rng = random.Random(0)
    shared = [rng.randrange(3, 500) for _ in range(8)]  # two blocks every prompt starts with: prefix hits
    for i in range(10):
        prompt = shared + [rng.randrange(3, 500) for _ in range(rng.randrange(1, 30))]
        sched.add_request(make_request(f"r{i}", prompt, max_tokens=rng.randrange(3, 14)))
    stage = NonSamplingStage()
    steps = 0
    while sched.has_unfinished_requests():
        so = sched.schedule()
        stage.apply(so)
        req_ids, sampled = [], []
        for req_id, n in so.num_scheduled_tokens.items():
            request = sched.requests[req_id]
            start = request.num_computed_tokens
            # what the stage feeds its layers this step is what the sampling stage has
            assert stage.tokens[req_id][start:start + n] == request.all_token_ids[start:start + n], req_id
            req_ids.append(req_id)
            done = start + n == request.num_tokens
            sampled.append([rng.randrange(3, 500)] if done else [])
        sched.update_from_output(so, ModelRunnerOutput(req_ids, sampled, [None] * len(req_ids)))
        steps += 1
        assert steps < 500
    stats = sched.get_stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0  # (the cases this test is for happened)


def test_without_pipeline_parallelism_no_tokens_are_sent():
    from halserve.scheduler_output import ModelRunnerOutput

    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16, max_model_len=64, block_size=BS,
                                      num_blocks=16))
    sched.add_request(make_request("a", [5, 6, 7], max_tokens=3))
    for _ in range(3):
        so = sched.schedule()
        assert all(c.new_token_ids == [] for c in so.scheduled_cached_reqs)
        sched.update_from_output(so, ModelRunnerOutput(["a"], [[9]], [None]))


def _runner_output(sched, so, rng):
    """What the last stage would answer: a token for each request that reached its end."""
    from halserve.scheduler_output import ModelRunnerOutput

    req_ids, sampled = [], []
    for req_id, n in so.num_scheduled_tokens.items():
        request = sched.requests.get(req_id)
        req_ids.append(req_id)
        done = request is not None and request.num_computed_tokens + n == request.num_tokens
        sampled.append([rng.randrange(3, 500)] if done else [])
    return ModelRunnerOutput(req_ids, sampled, [None] * len(req_ids))


def test_two_batches_in_flight_take_disjoint_halves_and_finish_everything():
    """One batch per stage in flight: a later batch skips requests in flight, takes its share of the
    running ones, and never preempts one in flight (its blocks are being computed on)."""
    from collections import deque

    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=48, max_model_len=128, block_size=BS,
                                      num_blocks=24, pipeline_parallel=True, max_concurrent_batches=2))
    rng = random.Random(1)
    for i in range(12):
        sched.add_request(make_request(f"r{i}", [rng.randrange(3, 500) for _ in range(rng.randrange(2, 20))],
                                       max_tokens=rng.randrange(4, 16)))
    stage = NonSamplingStage()
    in_flight: deque = deque()
    num_balanced = steps = 0
    while sched.has_unfinished_requests() or in_flight:
        if len(in_flight) < 2 and sched.has_unfinished_requests():
            num_running = sched.num_running
            so = sched.schedule()
            assert len(so.scheduled_cached_reqs) <= -(-num_running // 2)  # at most its half of them
            if so.is_empty:
                sched.unschedule_empty(so)
            else:
                stage.apply(so)
                ids = set(so.num_scheduled_tokens)
                for other in in_flight:
                    assert not ids & set(other.num_scheduled_tokens), "a request in two batches at once"
                for req_id, n in so.num_scheduled_tokens.items():
                    request = sched.requests[req_id]
                    start = request.num_computed_tokens
                    assert stage.tokens[req_id][start:start + n] == request.all_token_ids[start:start + n]
                if in_flight and len(so.scheduled_cached_reqs) and len(in_flight[0].scheduled_cached_reqs):
                    num_balanced += 1
                in_flight.append(so)
                if len(in_flight) < 2:
                    continue
        so = in_flight.popleft()
        for req_id in so.num_scheduled_tokens:  # whatever ran was not preempted meanwhile
            request = sched.requests.get(req_id)
            assert request is None or request.status.name == "RUNNING", req_id
        sched.update_from_output(so, _runner_output(sched, so, rng))
        steps += 1
        assert steps < 1000
    assert sched.num_in_flight == 0
    assert num_balanced > 5  # the two stages did work on different decode batches at once
    assert sched.get_stats().num_preemptions > 0


def test_an_aborted_request_in_flight_is_ignored_when_its_batch_returns():
    from halserve.request import RequestStatus

    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64, block_size=BS,
                                      num_blocks=32, pipeline_parallel=True, max_concurrent_batches=2))
    sched.add_request(make_request("a", [5, 6, 7], max_tokens=5))
    first = sched.schedule()
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    sched.add_request(make_request("a", [8, 9], max_tokens=5))  # the id again, while the old batch runs
    second = sched.schedule()
    assert second.is_empty, "the new 'a' waits until the old one's batch is back"
    sched.unschedule_empty(second)
    outputs = sched.update_from_output(first, _runner_output(sched, first, random.Random(0)))
    assert outputs == [] and sched.requests["a"].num_output_tokens == 0
    third = sched.schedule()
    assert [r.prompt_token_ids for r in third.scheduled_new_reqs] == [[8, 9]]
    assert "a" in third.finished_req_ids  # the workers drop the old one's state first
