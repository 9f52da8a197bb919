"""Summarise an sdp timeline (``SDP_TIMELINE=tl.json``): how much wall time each phase covers.

    SDP_TIMELINE=/tmp/tl.json sdprun -np 2 python examples/tf2_mnist.py --data-dir ../shared/data/mnist
    python benchmarks/timeline_report.py /tmp/tl.json

Prints, per phase, the union of its intervals over all tensors (seconds) and that as a share of the
timeline's span (first to last event), i.e. the fraction of training time spent in that phase.
"""
import argparse
import json

WAITING = ("NEGOTIATE", "QUEUE")  # phases in which a tensor waits for other ranks or collectives


def intervals(events):
    """{phase: [(start_us, end_us), ...]} from B/E pairs per (tid, phase)."""
    open_, out = {}, {}
    for e in sorted((e for e in events if e.get("ph") in ("B", "E")), key=lambda e: e["ts"]):
        key = (e["tid"], e["name"])
        if e["ph"] == "B":
            open_[key] = e["ts"]
        elif key in open_:
            out.setdefault(e["name"], []).append((open_.pop(key), e["ts"]))
    return out


def union_length(spans):
    total, end = 0.0, None
    for s, e in sorted(spans):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("timeline")
    p.add_argument("--skip-first-s", type=float, default=2.0,
                   help="ignore events in the first N seconds (tracing, first-step broadcast)")
    args = p.parse_args(argv)
    with open(args.timeline) as f:
        events = json.load(f)
    ts = [e["ts"] for e in events if "ts" in e]
    t0 = min(ts) + args.skip_first_s * 1e6
    events = [e for e in events if e.get("ts", t0) >= t0]
    span = max(ts) - t0
    print(f"timeline span {span / 1e6:.2f} s (after skipping the first {args.skip_first_s:g} s)")
    print(f"{'phase':<12}{'seconds':>10}{'share':>9}")
    comm = []
    for phase, spans in sorted(intervals(events).items()):
        length = union_length(spans)
        print(f"{phase:<12}{length / 1e6:>10.3f}{100 * length / span:>8.1f}%")
        if phase not in WAITING:
            comm += spans
    share = union_length(comm) / span
    print(f"{'engine work (all but NEGOTIATE, QUEUE)':<40}{100 * share:>8.1f}% of wall time")
    return share


if __name__ == "__main__":
    main()
