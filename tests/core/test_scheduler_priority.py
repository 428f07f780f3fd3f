"""Priority scheduling (``scheduling_policy="priority"``): lower ``Request.priority`` first, FCFS within
a level, lower priorities preempted (recompute) for a higher one that lacks a seat or blocks, outputs
the same as FCFS's; ``fcfs`` refuses a priority other than 0."""
import random

import pytest
from scheduler_helpers import make_request
from test_scheduler import BS, FakeWorker, step

from halserve.request import RequestStatus
from halserve.sched import PriorityWaitingQueue
from halserve.scheduler import Scheduler, SchedulerConfig


def make_scheduler(policy="priority", num_blocks=64, max_num_seqs=8, max_num_batched_tokens=64,
                   max_model_len=128):
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                     max_model_len=max_model_len, block_size=BS, num_blocks=num_blocks,
                                     scheduling_policy=policy))


def prioritized(req_id, prompt, priority, max_tokens=4):
    request = make_request(req_id, prompt, max_tokens=max_tokens)
    request.priority = priority
    return request


class Driver:
    """Steps a scheduler with a ``FakeWorker``, keeping every request's tokens and the finish order."""

    def __init__(self, sched):
        self.sched, self.worker = sched, FakeWorker()
        self.results: dict[str, tuple[list[int], str | None]] = {}
        self.order: list[str] = []

    def step(self):
        so, outs = step(self.sched, self.worker)
        for o in outs:
            toks = self.results.get(o.request_id, ([], None))[0]
            self.results[o.request_id] = (toks + o.new_token_ids, o.finish_reason)
            if o.finish_reason is not None:
                self.order.append(o.request_id)
        return so

    def finish(self, max_steps=2000):
        for _ in range(max_steps):
            if not self.sched.has_unfinished_requests():
                break
            self.step()
        assert not self.sched.has_unfinished_requests()
        assert self.sched.kv_cache_usage == 0.0
        return self.results, self.order


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_high_priority_behind_64_low_finishes_first(policy):
    # the acceptance: submitted after 64 low-priority requests (16 seats), the urgent one
    # finishes first; under FCFS it would finish last
    sched = make_scheduler(policy, num_blocks=80, max_num_seqs=16, max_num_batched_tokens=64)
    drv = Driver(sched)
    low = 5 if policy == "priority" else 0
    for i in range(64):
        sched.add_request(prioritized(f"low{i}", range(i, i + 8), priority=low, max_tokens=12))
    sched.add_request(prioritized("urgent", range(900, 908), priority=low - 6 if low else 0, max_tokens=12))
    results, order = drv.finish()
    assert order.index("urgent") == (0 if policy == "priority" else 64)
    assert len(order) == 65 and all(len(toks) == 12 and reason == "length" for toks, reason in results.values())


def test_high_priority_preempts_a_full_batch_and_finishes_first():
    # every seat is taken by a low-priority request with far to go; the urgent one takes a seat from
    # the latest-arrived at once and finishes before any of them
    sched = make_scheduler(num_blocks=80, max_num_seqs=16, max_num_batched_tokens=64)
    drv = Driver(sched)
    for i in range(64):
        sched.add_request(prioritized(f"low{i}", range(i, i + 4), priority=5, max_tokens=20))
    for _ in range(3):
        drv.step()
    assert sched.num_running == 16
    sched.add_request(prioritized("urgent", range(900, 908), priority=0, max_tokens=8))
    so = drv.step()
    assert [n.req_id for n in so.scheduled_new_reqs] == ["urgent"] and so.finished_req_ids == {"low15"}
    results, order = drv.finish()
    assert order[0] == "urgent"
    assert len(results["urgent"][0]) == 8 and all(len(results[f"low{i}"][0]) == 20 for i in range(64))


def test_preemption_for_blocks_keeps_outputs_identical_to_fcfs():
    # 6 usable blocks (24 tokens): two low-priority requests hold them; a high-priority one waits
    # for blocks (there is a free seat), preempts the latest-arrived low one, and every request's
    # tokens are those FCFS produces.
    specs = [("a", range(8), 3), ("b", range(100, 108), 3), ("hi", range(200, 208), 0)]

    def run(policy):
        sched = make_scheduler(policy, num_blocks=7, max_num_seqs=8)
        drv = Driver(sched)
        sched.add_request(prioritized("a", specs[0][1], specs[0][2] if policy == "priority" else 0, max_tokens=8))
        sched.add_request(prioritized("b", specs[1][1], specs[1][2] if policy == "priority" else 0, max_tokens=8))
        drv.step()
        drv.step()
        sched.add_request(prioritized("hi", specs[2][1], 0, max_tokens=8))
        return sched, *drv.finish()

    sched, prio_results, prio_order = run("priority")
    _, fcfs_results, fcfs_order = run("fcfs")
    assert prio_results == fcfs_results
    assert prio_order[0] == "hi" and fcfs_order[-1] == "hi"
    assert sched.num_preemptions >= 1


def test_victim_is_lowest_priority_latest_arrival_and_resumes():
    sched = make_scheduler(num_blocks=64, max_num_seqs=3)
    drv = Driver(sched)
    for req_id, prio in (("p1a", 1), ("p2", 2), ("p1b", 1)):
        sched.add_request(prioritized(req_id, range(8), prio, max_tokens=6))
    drv.step()
    assert [r.request_id for r in sched.running] == ["p1a", "p1b", "p2"]  # (sorted: priority, then arrival)
    sched.add_request(prioritized("top", range(50, 58), 0, max_tokens=6))
    so = drv.step()
    assert so.finished_req_ids == {"p2"} and so.num_preempted == 1  # the lowest priority, not the latest arrival
    assert [n.req_id for n in so.scheduled_new_reqs] == ["top"]
    assert sched.get_request("p2").status == RequestStatus.PREEMPTED
    results, _ = drv.finish()
    assert all(len(toks) == 6 for toks, _ in results.values())


def test_equal_or_higher_priority_is_never_preempted():
    sched = make_scheduler(num_blocks=64, max_num_seqs=2)
    drv = Driver(sched)
    sched.add_request(prioritized("a", range(8), 1, max_tokens=6))
    sched.add_request(prioritized("b", range(10, 18), 1, max_tokens=6))
    drv.step()
    sched.add_request(prioritized("c", range(20, 28), 1, max_tokens=6))  # same level: waits its turn
    for _ in range(3):
        so = drv.step()
        assert so.num_preempted == 0 and not so.scheduled_new_reqs
    _, order = drv.finish()
    assert order[-1] == "c"


def test_fcfs_within_a_level_and_lower_value_first():
    sched = make_scheduler(num_blocks=64, max_num_seqs=1)
    drv = Driver(sched)
    arrivals = [("x0", 2), ("y0", 1), ("x1", 2), ("y1", 1), ("z", 0), ("x2", 2)]
    for req_id, prio in arrivals:
        sched.add_request(prioritized(req_id, range(len(req_id), len(req_id) + 6), prio, max_tokens=3))
    _, order = drv.finish()
    assert order == ["z", "y0", "y1", "x0", "x1", "x2"]


def test_priority_outputs_equal_fcfs_randomized_with_preemption():
    rng = random.Random(1)
    specs = [(f"r{i}", [rng.randrange(500) for _ in range(rng.randrange(1, 12))], rng.randrange(1, 10),
              rng.randrange(-2, 3)) for i in range(24)]

    def run(policy, **kw):
        sched = make_scheduler(policy, **kw)
        drv = Driver(sched)
        for j, (req_id, prompt, max_tokens, prio) in enumerate(specs):
            sched.add_request(prioritized(req_id, prompt, prio if policy == "priority" else 0, max_tokens))
            if j % 4 == 3:
                drv.step()  # (arrivals spread over steps: later, higher priorities preempt)
        results, _ = drv.finish()
        return results, sched

    reference, _ = run("fcfs", num_blocks=200, max_num_batched_tokens=512)
    tight, sched = run("priority", num_blocks=9, max_num_seqs=4, max_num_batched_tokens=7)
    assert tight == reference
    assert sched.num_preemptions > 0


def test_fcfs_refuses_a_priority():
    sched = make_scheduler("fcfs")
    with pytest.raises(ValueError, match=r"priority=3 .*--scheduling-policy priority"):
        sched.add_request(prioritized("a", range(4), 3))
    assert not sched.has_unfinished_requests()
    sched.add_request(prioritized("b", range(4), 0))  # (0 is fine)


def test_bad_policy_is_refused():
    with pytest.raises(ValueError, match=r"scheduling_policy must be one of fcfs, priority, got 'lifo'"):
        make_scheduler("lifo")


def test_waiting_queue_abort_and_order():
    keys = {}
    queue = PriorityWaitingQueue(lambda r: keys[r.request_id])
    requests = [prioritized(f"r{i}", range(3), p) for i, p in enumerate([2, 0, 1, 0])]
    for rank, r in enumerate(requests):
        keys[r.request_id] = (r.priority, rank)
        queue.append(r)
    assert [r.request_id for r in queue] == ["r1", "r3", "r2", "r0"]
    queue.remove(requests[3])
    queue.appendleft(requests[3])  # (a preempted request goes back by its key, not to the front)
    assert [r.request_id for r in queue] == ["r1", "r3", "r2", "r0"]
    del queue[0]
    with pytest.raises(ValueError, match="not waiting"):
        queue.remove(requests[1])
    assert len(queue) == 3 and queue[0] is requests[3]


def test_abort_under_priority():
    sched = make_scheduler(max_num_seqs=1)
    drv = Driver(sched)
    sched.add_request(prioritized("a", range(4), 1))
    sched.add_request(prioritized("b", range(4), 0))
    sched.add_request(prioritized("c", range(4), 2))
    drv.step()
    sched.abort_requests(["c", "b"])
    results, order = drv.finish()
    assert order == ["a"]


def test_async_scheduling_with_priority_preemption_keeps_outputs():
    # the engine's async loop (step N+1 scheduled before step N's output is applied), with later,
    # higher-priority arrivals preempting running requests whose steps are in flight
    from collections import deque

    rng = random.Random(3)
    specs = [(f"r{i}", [rng.randrange(500) for _ in range(rng.randrange(1, 10))], rng.randrange(2, 9), -i // 3)
             for i in range(12)]

    def run(policy, async_scheduling, **kw):
        sched = Scheduler(SchedulerConfig(max_num_seqs=kw.get("max_num_seqs", 8), max_num_batched_tokens=16,
                                          max_model_len=64, block_size=BS, num_blocks=kw.get("num_blocks", 200),
                                          scheduling_policy=policy, async_scheduling=async_scheduling))
        worker, results, in_flight = FakeWorker(), {}, deque()
        pending = list(specs)
        for k in range(2000):
            while pending and k >= 2 * int(pending[0][0][1:]):  # (one arrival every other step)
                req_id, prompt, max_tokens, prio = pending.pop(0)
                sched.add_request(prioritized(req_id, prompt, prio if policy == "priority" else 0, max_tokens))
            if not sched.has_unfinished_requests() and not in_flight and not pending:
                break
            if sched.has_unfinished_requests():
                so = sched.schedule()
                if not so.is_empty:
                    in_flight.append((so, worker.execute(so)))
                    if async_scheduling and len(in_flight) == 1:
                        continue
                elif async_scheduling:
                    sched.unschedule_empty(so)
            if in_flight:
                for o in sched.update_from_output(*in_flight.popleft()):
                    results[o.request_id] = results.get(o.request_id, []) + o.new_token_ids
        assert not sched.has_unfinished_requests() and not in_flight and sched.kv_cache_usage == 0.0
        return results, sched

    reference, _ = run("fcfs", False)
    got, sched = run("priority", True, max_num_seqs=3, num_blocks=12)
    assert got == reference and sched.num_preemptions > 0
