"""``offload``'s pieces that run without a server: packing token-id lists for the trip from the
parsing worker, and freeing a big batch's lists a slice at a time (the server-level timing is
``test_server_event_loop``)."""
from __future__ import annotations

import sys
import threading
from array import array

from halserve.entrypoints.openai.offload import _free_in_slices, _pack_ids, _to_list


def test_free_in_slices_empties_what_it_owns_and_leaves_what_others_hold():
    shared = list(range(5000))
    owned_flat = list(range(200_000))
    nested = [[i] * 300 for i in range(100)] + [shared]
    values = [nested, owned_flat, "text", 7]
    _free_in_slices(values)
    assert values == []
    # (owned lists were emptied piecewise; `shared` is still held here, so it is only dropped)
    assert shared == list(range(5000))


def test_free_in_slices_lets_other_threads_run_between_slices():
    """The nested lists go one at a time: a thread sampling how many memory blocks the interpreter
    holds while they are freed sees counts part-way down (a one-call clear, which holds the GIL to
    its end, would let it see only before and after)."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        box = [[[j + 1000 for j in range(2048)] for _ in range(3000)]]  # (ints past the cached small ones)
        full = sys.getallocatedblocks()
        seen: list[int] = []
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                seen.append(sys.getallocatedblocks())

        sampler = threading.Thread(target=sample)
        sampler.start()
        try:
            _free_in_slices(box)
        finally:
            stop.set()
            sampler.join()
        empty = sys.getallocatedblocks()
    finally:
        sys.setswitchinterval(old)
    assert box == [] and full - empty > 3000 * 2000
    part_way = [n for n in seen if empty + 100_000 < n < full - 100_000]
    assert part_way, (full, empty, seen[:5], seen[-5:])


def test_pack_and_unpack_round_trip():
    ids = list(range(1000))
    batch = [list(range(300)), list(range(5))]
    assert isinstance(_pack_ids(ids), array) and _to_list(_pack_ids(ids)) == ids
    assert [_to_list(a) for a in _pack_ids(batch)] == batch
    assert _pack_ids(list(range(10))) == list(range(10))  # (short: as it is)
    assert _pack_ids([2**40] * 300) == [2**40] * 300  # (past int32: as it is)
    assert _to_list(array("i", range(200_000))) == list(range(200_000))
