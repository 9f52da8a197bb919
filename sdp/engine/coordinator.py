"""Negotiation on rank 0: a collective runs once every rank has submitted its name, in one order
that all ranks follow, after checking that every rank asked for the same thing.

Pure logic (no sockets), so it is unit-testable.  Requests carry a *meta* dict per tensor:

=====  =====================================================================
key    meaning
=====  =====================================================================
``n``  tensor name (unique among a rank's in-flight tensors)
``k``  kind: allreduce, allgather, broadcast, alltoall, reducescatter
``d``  numpy dtype string
``s``  shape (list of ints)
``o``  ReduceOp value (reductions) or None
``r``  root rank (broadcast) or None
``pre``/``post``  prescale / postscale factors
``sp`` alltoall splits (list of n ints) or None
``ps`` process set id (int), only for sets other than the global one (see
       :mod:`sdp.engine.process_sets`): ready once every rank of the set submitted it
``gs`` a flattened group's shapes (list of shapes), only for a group
       (:meth:`sdp.engine.runtime.Request.group`; ``s`` is then its flat size)
=====  =====================================================================

A **response cache** keeps steady state cheap: the first time a meta is agreed it gets an integer
id, sent once to all ranks; afterwards a rank submits just the id.  It holds one id per tensor
name: when a name is agreed with another signature (a new shape), its old id, and every cached
batch holding it, is forgotten (as Horovod's response cache replaces a name's entry), so a loop
of changing shapes keeps it bounded by the names in use (it grew ~1 KB per new shape, forever).
No rank can still send the old id: it learns the new one in the same response, and a name is in
flight at most once per rank.  A **batch cache** goes one
step further for the steady state of a training step: when every rank sends the very same list
of cached ids while nothing else is waiting, the response (items and fusion plan) is the one
computed the first time that list was seen, returned as a :class:`Batch` whose ``bid`` lets the
engine send ranks only that number.

**Capacity** (``cache_capacity``: ``SDP_CACHE_CAPACITY`` / ``HOROVOD_CACHE_CAPACITY``, default
1024): at most that many ids are *announced* (live on the ranks) at once.  A signature agreed
while the cache is full is negotiated in full (the ranks keep sending its meta) until an entry is
forgotten (its name agreed with another signature), when the next agreement of it announces it.
Unlike Horovod's LRU nothing is evicted while a rank may still send it, so no id in flight is ever
unknown.  0 turns the response cache, and with it the batch cache, off.
"""
import json
import logging
import math
import time
from typing import Dict, List, Optional, Tuple

import numpy as np

from sdp.common.reduce_ops import ReduceOp
from sdp.engine.fusion import plan_buckets

log = logging.getLogger("sdp.coordinator")

# fields that must agree on every rank (allgather: all but the first dimension of the shape)
CHECKED = (("k", "op"), ("d", "dtype"), ("o", "reduce op"), ("r", "root rank"),
           ("pre", "prescale factor"), ("post", "postscale factor"), ("ps", "process set"),
           ("dev", "memory (host or device)"), ("gs", "shapes of the grouped tensors"))


def stop_hint(stall_shutdown_s: float) -> str:
    """What a stall warning adds about ending the job: how, while ``SDP_STALL_SHUTDOWN_TIME`` is
    off (the default, as Horovod's: a hung rank holds the job for ever), else when."""
    if stall_shutdown_s > 0:
        return f" The job ends with StallError after SDP_STALL_SHUTDOWN_TIME={stall_shutdown_s:g} s."
    return (" The job waits for ever: set SDP_STALL_SHUTDOWN_TIME=<seconds> (e.g. 600) to end it with "
            "StallError on every rank instead.")


def wire_dtype(code: str) -> np.dtype:
    """The numpy dtype for a meta ``d`` field: a dtype string ('<f4') or a name ('bfloat16')."""
    if code[:1] in "<>|=":
        return np.dtype(code)
    import ml_dtypes  # registers bfloat16 & co. with numpy (installed with TensorFlow)
    return np.dtype(getattr(ml_dtypes, code))


KINDS = ("allreduce", "allgather", "broadcast", "alltoall", "reducescatter", "join")
JOIN = "__join__"  # the reserved name of join() requests
MAX_BATCHES = 1024  # distinct id lists kept in the batch cache (later ones take the normal path)


def malformed(meta) -> Optional[str]:
    """Why ``meta`` (from a peer's request) is not a well-formed meta, or None if it is: every
    key of the table above present with the right type, a known kind, dtype and reduce op."""
    if not isinstance(meta, dict):
        return f"not an object: {meta!r:.80}"
    ints = (lambda v: isinstance(v, list) and all(type(x) is int for x in v))  # (check() judges values)
    number = (lambda v: type(v) in (int, float))
    checks = (("n", lambda v: isinstance(v, str)), ("k", lambda v: v in KINDS),
              ("d", lambda v: isinstance(v, str)), ("s", ints),
              ("o", lambda v: v is None or (type(v) is int and v in ReduceOp._value2member_map_)),
              ("r", lambda v: v is None or type(v) is int), ("pre", number), ("post", number),
              ("sp", lambda v: v is None or ints(v)))
    for key, ok in checks:
        if key not in meta or not ok(meta[key]):
            return f"bad or missing {key!r}: {meta.get(key)!r:.80}"
    if "ps" in meta and type(meta["ps"]) is not int:
        return f"bad 'ps': {meta['ps']!r:.80}"
    if "gs" in meta and not (isinstance(meta["gs"], list) and all(ints(s) for s in meta["gs"])):
        return f"bad 'gs': {meta['gs']!r:.80}"
    if "dev" in meta and meta["dev"] not in (0, 1):
        return f"bad 'dev': {meta['dev']!r:.80}"
    if meta["k"] in ("allreduce", "reducescatter") and meta["o"] is None:
        return f"{meta['k']} without a reduce op"
    try:
        wire_dtype(meta["d"])
    except (TypeError, ValueError, AttributeError, ImportError):
        return f"unknown dtype {meta['d']!r:.80}"
    return None


def signature(meta: dict) -> str:
    return json.dumps(meta, sort_keys=True, separators=(",", ":"))


def _show(value) -> str:
    if isinstance(value, str):
        try:  # dtype strings such as '<f4' read better as 'float32'
            import numpy as np
            return np.dtype(value).name if value[:1] in "<>|=" else value
        except TypeError:
            return value
    return json.dumps(value)


def _describe(values: Dict[int, object]) -> str:
    groups: Dict[str, List[int]] = {}
    for rank in sorted(values):
        groups.setdefault(_show(values[rank]), []).append(rank)
    parts = []
    for val, ranks in groups.items():
        who = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
        parts.append(f"{who} {'has' if len(ranks) == 1 else 'have'} {val}")
    return ", ".join(parts)


def check(metas: Dict[int, dict], size: int, ranks=None) -> Optional[str]:
    """Return an error message if the ranks' metas for one name disagree, else None.
    ``ranks``: the job ranks of the process set (default: all ``size`` ranks)."""
    first = metas[min(metas)]
    name, kind = first["n"], first["k"]
    if kind not in ("allgather", "alltoall", "broadcast") and all(m is first or m == first for m in metas.values()):
        return None  # identical requests (always so in steady state: the same cached meta)
    for key, label in CHECKED:
        vals = {r: m.get(key) for r, m in metas.items()}
        if key == "o":
            vals = {r: ReduceOp(v).name if v is not None else None for r, v in vals.items()}
        elif key == "dev":
            vals = {r: "device" if v else "host" for r, v in vals.items()}
        if len(set(map(json.dumps, vals.values()))) > 1:
            what = kind if key != "k" else "collective"
            return f"{what} of '{name}': {label} mismatch, {_describe(vals)}"
    if kind == "allgather":
        vals = {r: m["s"][1:] for r, m in metas.items()}
        if any(len(m["s"]) == 0 for m in metas.values()):
            return f"allgather of '{name}': tensors must have at least one dimension, " \
                   f"{_describe({r: m['s'] for r, m in metas.items()})}"
        label = "shape (all but the first dimension)"
    elif kind == "alltoall":
        vals = {r: m["s"][1:] for r, m in metas.items()}
        label = "shape (all but the first dimension)"
        for r, m in metas.items():
            sp = m.get("sp")
            dim0 = m["s"][0] if m["s"] else 0
            if sp is None or len(sp) != size or sum(sp) != dim0 or min(sp, default=0) < 0:
                return (f"alltoall of '{name}': rank {r} has splits {sp} for first dimension {dim0}; "
                        f"splits must be {size} non-negative ints summing to the first dimension")
    else:
        vals = {r: m["s"] for r, m in metas.items()}
        label = "shape"
    if len(set(map(json.dumps, vals.values()))) > 1:
        return f"{kind} of '{name}': {label} mismatch, {_describe(vals)}"
    root = first.get("r")
    if kind == "broadcast" and ranks is not None:  # a process set: roots are job ranks in the set
        return None if root in ranks else f"broadcast of '{name}': root rank {root} is not in the process set"
    if kind == "broadcast" and not (isinstance(root, int) and 0 <= root < size):
        return f"broadcast of '{name}': root rank {root} is not a valid rank (world size {size})"
    return None


class Batch(list):
    """The response items of a cached batch (every rank sent the same list of cached ids);
    ``bid`` numbers it, the same on all ranks once announced.  Never modified after caching."""

    def __init__(self, items, bid: int):
        super().__init__(items)
        self.bid = bid


class Coordinator:
    """Collects requests from all ranks and decides what runs, in which order."""

    def __init__(self, size: int, stall_check_s: float = 60.0, stall_shutdown_s: float = 0.0,
                 fusion_threshold: int = 25 * 1024 * 1024, cache_capacity: int = 1024):
        self.size = size
        self.cache_capacity = cache_capacity  # ids announced to the ranks at most (module docstring)
        self._announced = set()  # cache ids the ranks know (they may send them instead of metas)
        self.fusion_threshold = fusion_threshold  # bytes per bucket; 0: no fusion
        self.stall_check_s = stall_check_s
        self.stall_shutdown_s = stall_shutdown_s
        self.table: Dict[str, Dict[int, dict]] = {}  # name -> rank -> meta
        self.first_seen: Dict[str, float] = {}
        self.order: List[str] = []  # names in order of first submission
        self.cache_ids: Dict[str, int] = {}  # signature -> id
        self.cache_meta: Dict[int, dict] = {}  # id -> meta
        self._cid_of_name: Dict[str, int] = {}  # tensor name -> its id (one per name)
        self._sig_of: Dict[int, str] = {}  # id -> signature
        self._next_cid = 0
        self._cid_of: Dict[int, int] = {}  # id() of a meta in cache_meta -> its cache id
        self._fusion_infos: Dict[int, tuple] = {}  # cache id -> _fusion_info()
        self._warned: Dict[str, float] = {}
        self.joined: List[int] = []  # ranks that called join(), in order
        self._held: Dict[int, list] = {}  # rank -> ids: same-list requests held for the batch cache
        self._held_since = 0.0
        self._batches: Dict[tuple, Batch] = {}  # (ids, fusion threshold) -> cached response
        self._batch_keys: Dict[int, set] = {}  # id -> keys of the cached batches holding it
        self._free_bids: List[int] = []  # numbers of forgotten batches, given to new ones
        #: process set id -> its job ranks, ascending (sdp.engine.process_sets; 0, all ranks, implicit)
        self.sets: Dict[int, List[int]] = {}
        self._set_cids = set()  # cache ids of process-set metas (they never take the batch cache)

    def _can_hold(self, rank: int, request: dict) -> bool:
        """Whether ``request`` may wait in the batch-cache fast path: cached ids only, nothing
        else waiting, and the same id list as the ranks already held.  (A list with an unknown
        or repeated id takes the normal path, which reports it.)"""
        ids = request.get("ids")
        if request.get("new") or not ids or self.table or self.joined or rank in self._held:
            return False
        if self._held:
            return ids == next(iter(self._held.values()))
        known = self._announced
        return (isinstance(ids, list) and all(type(c) is int and c in known for c in ids)
                and len(set(ids)) == len(ids) and (not self._set_cids or self._set_cids.isdisjoint(ids)))

    def _release_held(self) -> List[dict]:
        """Move held requests into the table, in arrival order (as if added normally)."""
        held, self._held = self._held, {}
        errors = []
        for r, ids in held.items():
            errors += self._add(r, {"ids": ids}, self._held_since)
        return errors

    def add(self, rank: int, request: dict) -> List[dict]:
        """Record ``request`` (``{"new": [meta...], "ids": [int...]}``) from ``rank``.

        Returns error items for requests that are malformed (unknown cache id, duplicate name)."""
        now = time.monotonic()
        if self._can_hold(rank, request):
            if not self._held:
                self._held_since = now
            self._held[rank] = request["ids"]
            return []
        return self._release_held() + self._add(rank, request, now)

    def _add(self, rank: int, request: dict, now: float) -> List[dict]:
        errors, metas = [], []
        new, ids = request.get("new", []), request.get("ids", [])
        if not isinstance(new, list) or not isinstance(ids, list):
            log.warning("coordinator: dropping malformed request from rank %d: %.200r", rank, request)
            return errors
        for meta in new:
            why = malformed(meta)
            if why is None:
                metas.append(meta)
            else:
                log.warning("coordinator: rank %d sent a malformed tensor request (%s); dropped", rank, why)
        for cid in ids:
            if type(cid) is not int or cid not in self._announced:
                log.warning("coordinator: rank %d sent unknown cache id %r; dropped", rank, cid)
                continue
            metas.append(self.cache_meta[cid])
        for meta in metas:
            name = meta["n"]
            if meta.get("k") == "join":
                if rank not in self.joined:
                    self.joined.append(rank)
                continue
            ps = meta.get("ps", 0)
            if ps and rank not in self.sets.get(ps, ()):
                why = ("is not registered" if ps not in self.sets
                       else f"has ranks {self.sets[ps]}, not rank {rank}")
                errors.append({"n": name, "err": f"{meta['k']} of '{name}' submitted by rank {rank} on process "
                               f"set {ps}, which {why}", "ranks": [rank]})
                continue
            entry = self.table.setdefault(name, {})
            if rank in entry:
                errors.append({"n": name, "err": f"rank {rank} submitted '{name}' twice before it completed",
                               "ranks": [rank]})
                continue
            if not entry:
                self.first_seen[name] = now
                self.order.append(name)
            entry[rank] = meta
        return errors

    def ready(self) -> List[dict]:
        """Pop the names every rank has submitted (or joined past), in first-submission order,
        as response items.

        An item is ``{"n", "id", "meta"?, "dim0"?, "splits"?, "jm"?}`` — ``meta`` only the first
        time a signature is agreed, ``jm`` (the meta) when joined ranks must contribute zeros —
        or, when the ranks disagree, ``{"n", "err", "ranks"}``.  Once every rank has joined, the
        last item is ``{"n": JOIN, "last": rank that joined last}``."""
        if self._held and len(self._held) == self.size:  # every rank sent the same cached ids
            key = (tuple(next(iter(self._held.values()))), self.fusion_threshold)
            batch = self._batches.get(key)
            if batch is not None:
                self._held = {}
                return batch
            items = self._release_held() + self._ready()
            if (len(self._batches) < MAX_BATCHES and len(items) == len(key[0])
                    and all(it.keys() <= {"n", "id", "b"} for it in items)
                    and all(c in self.cache_meta for c in key[0])):
                # (numbers of forgotten batches are reused: live + free are always 0 .. n-1)
                bid = self._free_bids.pop() if self._free_bids else len(self._batches)
                items = self._batches[key] = Batch(items, bid)
                for c in key[0]:
                    self._batch_keys.setdefault(c, set()).add(key)
            return items
        return self._ready()

    def _ready(self) -> List[dict]:
        items, keep = [], []
        joined = set(self.joined)
        for name in self.order:
            entry = self.table[name]
            ps = next(iter(entry.values())).get("ps", 0)
            if ps:  # a process set: its ranks submit, no joins (see sdp.engine.process_sets)
                members = self.sets.get(ps, ())
                if len(entry) < len(members):
                    keep.append(name)
                    continue
            elif len(entry) < self.size and (not joined or len(set(entry) | joined) < self.size):
                keep.append(name)
                continue
            del self.table[name]
            self.first_seen.pop(name, None)
            if self._warned:
                self._warned.pop(name, None)
            n = len(members) if ps else self.size
            first = entry.get(members[0] if ps and members else 0)
            cid = self._cid_of.get(id(first))
            if cid is not None and len(entry) == n and all(m is first for m in entry.values()):
                # steady state: every rank sent the same cache id
                items.append({"n": name, "id": cid, "ps": ps} if ps else {"n": name, "id": cid})
                continue
            absent = [] if len(entry) == self.size or ps else sorted(set(range(self.size)) - set(entry))
            err = check(entry, n, members) if ps else check(entry, self.size)
            if ps and not err and sorted(entry) != list(members):
                err = f"'{name}': submitted by ranks {sorted(entry)}, process set {ps} has ranks {list(members)}"
            first = entry[min(entry)]
            if not err and absent and not (first["k"] == "allreduce" and first["o"] in (0, 1)):
                err = (f"{first['k']} of '{name}': ranks {absent} have already called join(); after join "
                       "only allreduce with op SUM or AVERAGE can run")
            if err:
                if ps:
                    err += f" (process set {ps}, ranks {list(members)})"
                items.append({"n": name, "err": err, "ranks": list(members) if ps else list(range(self.size))})
                continue
            meta = first
            item = {"n": name, "ps": ps} if ps else {"n": name}
            if absent:
                item["jm"] = meta
            order = members if ps else range(self.size)
            if meta["k"] in ("allgather", "alltoall"):
                item["dim0"] = [entry[r]["s"][0] for r in order]
                if meta["k"] == "alltoall":
                    item["splits"] = [entry[r]["sp"] for r in order]
            cid = self._cid_of.get(id(meta))  # steady state: a cached meta object, no JSON
            if cid is None:
                sig = signature(meta)
                cid = self.cache_ids.get(sig)
                if cid is None:
                    self._forget(self._cid_of_name.get(name))  # the name's old signature
                    cid = self.cache_ids[sig] = self._next_cid
                    self._next_cid += 1
                    self.cache_meta[cid] = meta
                    self._cid_of[id(meta)] = cid
                    self._cid_of_name[name] = cid
                    self._sig_of[cid] = sig
                if (cid not in self._announced and len(self._announced) < self.cache_capacity
                        and meta["k"] not in ("allgather", "alltoall")):  # (those travel in full: per-rank shapes)
                    self._announced.add(cid)  # the ranks learn it: from now on they send the id
                    item["meta"] = self.cache_meta[cid]
            item["id"] = cid
            if ps:
                self._set_cids.add(cid)
            items.append(item)
        self.order = keep
        self._plan_fusion(items)
        if len(joined) == self.size:
            items.append({"n": JOIN, "last": self.joined[-1]})
            self.joined = []
        return items

    def _forget(self, cid: Optional[int]) -> None:
        """Drop cache id ``cid`` (if not None) and the cached batches that hold it."""
        if cid is None:
            return
        meta = self.cache_meta.pop(cid)
        self._announced.discard(cid)
        del self.cache_ids[self._sig_of.pop(cid)]
        self._cid_of.pop(id(meta), None)
        self._fusion_infos.pop(cid, None)
        self._set_cids.discard(cid)
        for key in self._batch_keys.pop(cid, ()):
            self._free_bids.append(self._batches.pop(key).bid)
            for c in key[0]:
                if c != cid:
                    self._batch_keys[c].discard(key)

    def _plan_fusion(self, items: List[dict]) -> None:
        """Give each allreduce item its bucket index ``b`` (same plan for every rank)."""
        ars = [it for it in items if "id" in it and self._fusion_info(it["id"])[0]]
        if not ars:
            return
        nbytes = {it["n"]: self._fusion_info(it["id"])[1] for it in ars}
        key = lambda it: self._fusion_info(it["id"])[2]
        for b, bucket in enumerate(plan_buckets(ars, nbytes, key, self.fusion_threshold)):
            for it in bucket:
                it["b"] = b

    def _fusion_info(self, cid: int) -> tuple:
        """``(is allreduce, bytes, fusion key)`` of cached meta ``cid`` (computed once)."""
        info = self._fusion_infos.get(cid)
        if info is None:
            m = self.cache_meta[cid]
            info = self._fusion_infos[cid] = (m["k"] == "allreduce", math.prod(m["s"]) * wire_dtype(m["d"]).itemsize,
                                              (m["d"], m["o"], m["pre"], m["post"], m.get("ps", 0),
                                               m.get("dev", 0)))
        return info

    def stalls(self, now: Optional[float] = None) -> Tuple[List[str], Optional[str]]:
        """Return (warnings to log, fatal message or None) for names waiting on some ranks:
        a warning once per ``stall_check_s`` seconds a name waits, fatal once one has waited
        ``stall_shutdown_s`` (either may come first; 0 turns either off)."""
        now = time.monotonic() if now is None else now
        check, shutdown = self.stall_check_s or math.inf, self.stall_shutdown_s or math.inf  # 0: off
        first = min(check, shutdown)
        if self._held and now - self._held_since >= first:
            self._release_held()  # some rank is late: name it like any other stalled tensor
        warnings, fatal = [], None
        late = {}
        for name in self.order:
            age = now - self.first_seen[name]
            if age >= first:
                entry = self.table[name]
                ps = next(iter(entry.values())).get("ps", 0)
                missing = sorted(set(self.sets.get(ps, ()) if ps else range(self.size)) - set(entry))
                late[name] = (age, missing)
        if not late:
            return warnings, None
        fresh = [n for n in late if late[n][0] >= check and now - self._warned.get(n, -1e18) >= check]
        if fresh:
            desc = "; ".join(f"'{n}' (waited {late[n][0]:.0f} s, missing ranks {late[n][1]})" for n in fresh)
            warnings.append("stall: some ranks submitted tensors that other ranks have not: " + desc +
                            ". One or more ranks may have stopped calling collectives or call them "
                            "in a different set." + stop_hint(self.stall_shutdown_s))
            for n in fresh:
                self._warned[n] = now
        if shutdown < math.inf:
            over = [n for n, (age, _) in late.items() if age >= shutdown]
            if over:
                fatal = ("stall: " + "; ".join(f"'{n}' missing ranks {late[n][1]}" for n in over) +
                         f" for more than SDP_STALL_SHUTDOWN_TIME={self.stall_shutdown_s:g} s")
        return warnings, fatal
