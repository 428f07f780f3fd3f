"""Pipeline parallelism, the scheduler's part: the stages before the last never sample, so each
scheduled cached request carries the output tokens sampled since the workers last heard of it
(``CachedRequestData.new_token_ids``). A non-sampling stage that keeps its request state only
from those diffs must know every token it is asked to compute, through chunked prefill,
preemption and resumption, and prefix-cache hits."""
import random

from halserve.scheduler import Scheduler
from scheduler_helpers import make_request

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

    sched = Scheduler(max_num_seqs=6, max_num_batched_tokens=24, max_model_len=128, block_size=BS, num_blocks=20,
                      pipeline_parallel=True)
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

    sched = Scheduler(max_num_seqs=2, max_num_batched_tokens=16, max_model_len=64, block_size=BS, num_blocks=16)
    sched.add_request(make_request("a", [5, 6, 7], max_tokens=3))
    for _ in range(3):
        so = sched.schedule()
        assert all(c.new_token_ids == [] for c in so.scheduled_cached_reqs)
        sched.update_from_output(so, ModelRunnerOutput(["a"], [[9]], [None]))
