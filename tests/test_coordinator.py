"""Negotiation logic (no sockets): ordering, mismatch messages, response cache, stalls."""
import time

import numpy as np
import pytest

from sdp.engine.coordinator import Coordinator, check


def meta(name, shape=(2,), dtype="<f4", kind="allreduce", op=1, root=None):
    return {"n": name, "k": kind, "d": dtype, "s": list(shape), "o": op, "r": root, "pre": 1.0,
            "post": 1.0, "sp": None}


def test_ready_only_when_all_ranks_submitted_in_first_seen_order():
    c = Coordinator(3)
    c.add(0, {"new": [meta("a"), meta("b")]})
    c.add(1, {"new": [meta("b"), meta("a")]})
    assert c.ready() == []
    c.add(2, {"new": [meta("b")]})
    assert [i["n"] for i in c.ready()] == ["b"]
    c.add(2, {"new": [meta("a")]})
    assert [i["n"] for i in c.ready()] == ["a"]


def test_response_cache_ids_replace_metadata_in_steady_state():
    c = Coordinator(2)
    c.add(0, {"new": [meta("g")]})
    c.add(1, {"new": [meta("g")]})
    first = c.ready()[0]
    assert "meta" in first and first["id"] == 0
    c.add(0, {"ids": [0]})
    c.add(1, {"ids": [0]})
    second = c.ready()[0]
    assert second == {"n": "g", "id": 0, "b": 0}  # no metadata travels once cached


def test_cached_id_against_new_shape_is_a_mismatch():
    c = Coordinator(2)
    c.add(0, {"new": [meta("g")]})
    c.add(1, {"new": [meta("g")]})
    c.ready()
    c.add(0, {"ids": [0]})
    c.add(1, {"new": [meta("g", shape=(3,))]})
    item = c.ready()[0]
    assert item["err"] == "allreduce of 'g': shape mismatch, rank 0 has [2], rank 1 has [3]"


def test_mismatch_groups_ranks_with_equal_values():
    metas = {0: meta("x"), 1: meta("x", dtype="<f8"), 2: meta("x", dtype="<f8")}
    assert check(metas, 3) == "allreduce of 'x': dtype mismatch, rank 0 has float32, ranks 1, 2 have float64"


def test_duplicate_submission_and_unknown_cache_id():
    c = Coordinator(2)
    c.add(0, {"new": [meta("d")]})
    errs = c.add(0, {"new": [meta("d")], "ids": [99]})
    assert errs and "submitted 'd' twice" in errs[0]["err"]


def test_stall_warning_names_missing_ranks_then_fatal():
    c = Coordinator(3, stall_check_s=1.0, stall_shutdown_s=5.0)
    c.add(0, {"new": [meta("late")]})
    c.add(2, {"new": [meta("late")]})
    t0 = c.first_seen["late"]
    warnings, fatal = c.stalls(t0 + 2)
    assert len(warnings) == 1 and "missing ranks [1]" in warnings[0] and fatal is None
    assert c.stalls(t0 + 2.5) == ([], None)  # not repeated every cycle
    _, fatal = c.stalls(t0 + 6)
    assert fatal and "'late' missing ranks [1]" in fatal


def test_coordinator_plans_fusion_buckets_by_threshold_and_key():
    c = Coordinator(2, fusion_threshold=100)
    ms = [meta(f"g{i}", shape=(10,)) for i in range(5)] + [meta("d", shape=(10,), dtype="<f8")]
    for r in (0, 1):
        c.add(r, {"new": ms})
    items = {i["n"]: i["b"] for i in c.ready()}
    # 40-byte float32 tensors: two per 100-byte bucket; the float64 one has its own
    assert [items[f"g{i}"] for i in range(5)] == [0, 0, 1, 1, 2]
    assert items["d"] not in (0, 1, 2)
    c.fusion_threshold = 0
    for r in (0, 1):
        c.add(r, {"ids": [0, 1]})
    assert len({i["b"] for i in c.ready()}) == 2  # no fusion


def cached(c, names, size=2, shape=(10,)):
    """Agree ``names`` once (normal path) so that they have cache ids 0, 1, ..."""
    ms = [meta(n, shape=shape) for n in names]
    for r in range(size):
        c.add(r, {"new": ms})
    c.ready()


def test_batch_cache_reuses_the_response_of_an_identical_id_list():
    c = Coordinator(2, fusion_threshold=100)
    cached(c, ["g0", "g1", "g2"])
    c.add(0, {"ids": [0, 1, 2]})
    assert c.ready() == []
    c.add(1, {"ids": [0, 1, 2]})
    first = c.ready()
    assert [(i["n"], i["b"]) for i in first] == [("g0", 0), ("g1", 0), ("g2", 1)]
    assert first.bid == 0
    c.add(1, {"ids": [0, 1, 2]})  # arrival order does not matter
    c.add(0, {"ids": [0, 1, 2]})
    assert c.ready() is first
    c.fusion_threshold = 0  # a new plan: a new batch
    for r in (0, 1):
        c.add(r, {"ids": [0, 1, 2]})
    again = c.ready()
    assert again.bid == 1 and len({i["b"] for i in again}) == 3


def test_response_cache_holds_one_id_per_name_and_forgets_batches_of_old_ids():
    c = Coordinator(2)
    cached(c, ["g0", "g1"])
    for r in (0, 1):
        c.add(r, {"ids": [0, 1]})
    assert c.ready().bid == 0
    for step in range(1, 50):  # g1 comes back with a new shape each time (a soak's random sizes)
        cached(c, ["g1"], shape=(10 + step,))
    assert sorted(c.cache_meta) == [0, 50] and len(c.cache_ids) == 2  # g0's id and g1's latest
    assert not c._batches and c._free_bids == [0]  # the batch holding g1's first id is gone
    errs = c.add(0, {"ids": [1]})  # an id forgotten is unknown, as any other
    assert c.ready() == [] and not errs and not c.table
    for r in (0, 1):
        c.add(r, {"ids": [0, 50]})
    again = c.ready()
    assert [i["n"] for i in again] == ["g0", "g1"] and again.bid == 0  # its number is reused


def test_differing_id_lists_take_the_normal_path_in_first_seen_order():
    c = Coordinator(2)
    cached(c, ["a", "b"])
    c.add(0, {"ids": [0, 1]})  # held for the batch cache ...
    c.add(1, {"ids": [1]})  # ... then released: rank 1 sent another list
    items = c.ready()
    assert [i["n"] for i in items] == ["b"] and not hasattr(items, "bid")
    c.add(1, {"ids": [0]})
    assert [i["n"] for i in c.ready()] == ["a"]


def test_held_batch_still_reports_the_missing_rank_and_repeated_ids():
    c = Coordinator(3, stall_check_s=1.0)
    cached(c, ["x"], size=3)
    c.add(0, {"ids": [0]})
    c.add(2, {"ids": [0]})
    warnings, _ = c.stalls(time.monotonic() + 2)
    assert len(warnings) == 1 and "'x'" in warnings[0] and "missing ranks [1]" in warnings[0]
    c2 = Coordinator(2)
    cached(c2, ["y"])
    errs = c2.add(0, {"ids": [0, 0]})
    assert errs and "submitted 'y' twice" in errs[0]["err"]


def test_stall_check_zero_is_off_and_shutdown_may_come_first():
    c = Coordinator(2, stall_check_s=0.0, stall_shutdown_s=0.0)
    c.add(0, {"new": [meta("lonely")]})
    assert c.stalls(time.monotonic() + 1e6) == ([], None)  # neither warns nor aborts
    c = Coordinator(2, stall_check_s=60.0, stall_shutdown_s=5.0)
    t0 = time.monotonic()
    c.add(0, {"new": [meta("lonely")]})
    warnings, fatal = c.stalls(t0 + 6)
    assert warnings == [] and "'lonely' missing ranks [1]" in fatal and "SDP_STALL_SHUTDOWN_TIME=5" in fatal


def test_requests_refuse_what_no_rank_could_run():
    from sdp.common.reduce_ops import ReduceOp
    from sdp.engine.runtime import Request
    with pytest.raises(ValueError, match="reducescatter of 'x': needs at least one dimension"):
        Request("x", "reducescatter", np.float32(1.0))
    with pytest.raises(ValueError, match="allreduce of 'b': bool tensors take SUM/MAX"):
        Request("b", "allreduce", np.ones(2, bool), op=ReduceOp.AVERAGE)
    assert Request("b", "allreduce", np.ones(2, bool), op=ReduceOp.MIN).array.dtype == bool
    with pytest.raises(TypeError, match="allreduce: name must be a str, got int 5"):
        Request(5, "allreduce", np.ones(2))


def _agree(c, ranks, request):
    for r in range(ranks):
        c.add(r, request)
    return c.ready()


def test_cache_capacity_bounds_the_ids_announced():
    c = Coordinator(2, cache_capacity=2)
    items = _agree(c, 2, {"new": [meta("a"), meta("b"), meta("c")]})
    assert [("meta" in i) for i in items] == [True, True, False]  # 'c' is agreed but not cached
    assert {i["n"]: i["id"] for i in items if "meta" in i} == {"a": 0, "b": 1}
    # 'c' keeps being negotiated in full (an id the ranks were never told is unknown)
    again = _agree(c, 2, {"ids": [0, 1], "new": [meta("c")]})
    assert sorted(i["n"] for i in again) == ["a", "b", "c"] and not any("meta" in i for i in again)
    assert c.add(0, {"ids": [items[2]["id"]]}) == [] and c.table == {}  # unknown id: dropped, logged
    # 'a' agreed with a new shape forgets its old id (Horovod replaces a name's entry): its slot
    # goes to the new signature, and 'c' still travels in full
    items = _agree(c, 2, {"new": [meta("a", shape=(5,))]})
    assert items[0].get("meta") == meta("a", shape=(5,)) and len(c._announced) == 2
    assert "meta" not in _agree(c, 2, {"new": [meta("c")]})[0]


def test_cache_capacity_zero_sends_every_request_in_full_and_still_checks():
    c = Coordinator(2, cache_capacity=0)
    for _ in range(3):
        items = _agree(c, 2, {"new": [meta("g")]})
        assert [i["n"] for i in items] == ["g"] and "meta" not in items[0] and "b" in items[0]
    c.add(0, {"new": [meta("g")]})
    c.add(1, {"new": [meta("g", dtype="<f8")]})
    assert c.ready()[0]["err"] == "allreduce of 'g': dtype mismatch, rank 0 has float32, rank 1 has float64"
    assert c._batches == {}  # no ids: no batch cache either


def test_group_shapes_must_agree_and_be_well_formed():
    """A flattened group (``gs``: its tensors' shapes) with the same flat size but other shapes
    on one rank is a mismatch naming both; a ``gs`` that is not a list of int lists is malformed."""
    from sdp.engine.coordinator import malformed
    a, b = meta("g", shape=(10,)), meta("g", shape=(10,))
    a["gs"], b["gs"] = [[2, 3], [4]], [[3, 2], [4]]
    assert check({0: a, 1: b}, 2) == ("allreduce of 'g': shapes of the grouped tensors mismatch, "
                                      "rank 0 has [[2, 3], [4]], rank 1 has [[3, 2], [4]]")
    assert check({0: a, 1: dict(a)}, 2) is None
    assert malformed(a) is None
    for bad in ([2, 3], [[2.5]], "x", [["1"]]):
        assert malformed({**a, "gs": bad}) == f"bad 'gs': {bad!r:.80}"
