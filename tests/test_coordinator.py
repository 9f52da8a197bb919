"""Negotiation logic (no sockets): ordering, mismatch messages, response cache, stalls."""
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
