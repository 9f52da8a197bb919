"""Workers for tests/test_process_sets_mp.py: process sets of 2 and 3 ranks in a 4-rank job."""
import os

import numpy as np

A_RANKS, B_RANKS = [0, 1], [1, 2, 3]  # overlapping: rank 1 is in both


def _data(rank, tag, shape, dtype=np.float32):
    n = int(np.prod(shape))
    return ((np.arange(n) % 97) * (rank + 1) + tag).astype(dtype).reshape(shape)


def _check(results, key, got, want):
    got, want = np.asarray(got), np.asarray(want)
    ok = got.shape == want.shape and got.dtype == want.dtype and np.allclose(got, want, rtol=1e-5)
    results[key] = bool(ok) if ok else f"got {got.dtype}{got.shape} {got.ravel()[:5]}, want {want.dtype}{want.shape} {want.ravel()[:5]}"


def numpy_sets():
    """Collectives on both sets and the global set, all in flight at once; each result against
    numpy.  Returns {check name: True or what differed}."""
    from sdp import api
    from sdp.engine import collectives
    me = api.rank()
    ids = api.add_process_sets([A_RANKS, B_RANKS])
    res = {"ids": ids}
    handles = []  # (key, handle, reference)
    for ps, members in zip(ids, (A_RANKS, B_RANKS)):
        if me not in members:
            continue
        t = ps * 10
        # the same name on both sets, and on the global set below: kept apart per set
        handles.append((f"ar_sum{ps}", api.allreduce_async(_data(me, t, (1000,)), "grad", op=api.ReduceOp.SUM,
                                                           process_set=ps),
                        sum(_data(r, t, (1000,)) for r in members)))
        big = (300_000,)  # 1.2 MB: the ring with segments
        handles.append((f"ar_avg_big{ps}", api.allreduce_async(_data(me, t + 1, big), op=api.ReduceOp.AVERAGE,
                                                               process_set=ps),
                        sum(_data(r, t + 1, big) for r in members) / np.float32(len(members))))
        ints = [_data(r, t + 2, (5, 3), np.int32) for r in members]
        handles.append((f"ar_int_avg{ps}", api.allreduce_async(ints[members.index(me)], op=api.ReduceOp.AVERAGE,
                                                               process_set=ps),
                        sum(ints) // len(members)))
        handles.append((f"ag{ps}", api.allgather_async(_data(me, t + 3, (me + 1, 3)), process_set=ps),
                        np.concatenate([_data(r, t + 3, (r + 1, 3)) for r in members])))
        root = members[-1]
        handles.append((f"bc{ps}", api.broadcast_async(_data(me, t + 4, (4, 4), np.float64), root, process_set=ps),
                        _data(root, t + 4, (4, 4), np.float64)))
        group = api.grouped_allreduce_async([_data(me, t + 5, (3,)), _data(me, t + 6, (2, 2))],
                                            op=api.ReduceOp.SUM, process_set=ps)
        handles.append((f"grouped0_{ps}", group[0], sum(_data(r, t + 5, (3,)) for r in members)))
        handles.append((f"grouped1_{ps}", group[1], sum(_data(r, t + 6, (2, 2)) for r in members)))
    handles.append(("ar_global", api.allreduce_async(_data(me, 99, (1000,)), "grad", op=api.ReduceOp.SUM),
                    sum(_data(r, 99, (1000,)) for r in range(api.size()))))
    for key, h, want in handles:
        _check(res, key, h.wait(timeout=60), want)
    for ps, members in zip(ids, (A_RANKS, B_RANKS)):
        if me not in members:
            continue
        t = ps * 10
        rows = collectives._bounds(7, len(members))
        i = members.index(me)
        full = sum(_data(r, t + 7, (7, 2)) for r in members)
        _check(res, f"rs{ps}", api.reducescatter(_data(me, t + 7, (7, 2)), op=api.ReduceOp.SUM, process_set=ps),
               full[rows[i]:rows[i + 1]])
        splits = [j + 1 for j in range(len(members))]  # member i sends j+1 rows to member j
        send = _data(me, t + 8, (sum(splits), 2))
        got, rsplits = api.alltoall(send, splits, process_set=ps)
        want = np.concatenate([_data(r, t + 8, (sum(splits), 2))[sum(splits[:i]):sum(splits[:i + 1])]
                               for r in members])
        _check(res, f"a2a{ps}", got, want)
        res[f"a2a_splits{ps}"] = rsplits.tolist() == [i + 1] * len(members)
        res[f"bobj{ps}"] = api.broadcast_object({"from": members[0]}, members[0], process_set=ps) == {"from": members[0]}
        res[f"gobj{ps}"] = api.allgather_object(me, process_set=ps) == members
    api.barrier()
    return res


def numpy_errors():
    """The error cases; returns {case: error type and message}."""
    from sdp import api
    me = api.rank()
    out = {}
    a, b = api.add_process_sets([A_RANKS, B_RANKS])

    def catch(key, fn):
        try:
            fn()
            out[key] = None
        except Exception as e:  # noqa: BLE001 - the test looks at type and message
            out[key] = f"{type(e).__name__}: {e}"

    # a rank outside the set calls its collective: refused at once on that rank
    if me not in A_RANKS:
        catch("outsider", lambda: api.allreduce(np.ones(3), "x", process_set=a))
    catch("unknown", lambda: api.allreduce(np.ones(3), "y", process_set=77))
    # a broadcast root outside the set: every member raises, naming the set
    if me in A_RANKS:
        catch("root", lambda: api.broadcast(np.ones(2), 3, "bad_root", process_set=a))
    # members disagree on the shape: every member of B raises, naming the set
    if me in B_RANKS:
        catch("shape", lambda: api.allreduce(np.ones(me + 1), "bad_shape", process_set=b))
    catch("duplicate", lambda: api.add_process_sets([[1, 0]]))
    catch("bad_ranks", lambda: api.add_process_sets([[0, 9]]))
    catch("global_dup", lambda: api.add_process_sets([[3, 2, 1, 0]]))
    catch("differ", lambda: api.add_process_sets([[0, 2]] if me == 2 else [[0, 3]]))
    # the job still works: sets and global
    if me in B_RANKS:
        out["after"] = api.allreduce(np.ones(2), "after", op=api.ReduceOp.SUM, process_set=b).tolist()
    out["removed"] = api.remove_process_set(a)
    out["removed_again"] = api.remove_process_set(a)
    if me in A_RANKS:
        catch("use_removed", lambda: api.allreduce(np.ones(3), "z", process_set=a))
    out["global"] = api.allreduce(np.ones(1), op=api.ReduceOp.SUM).tolist()
    return out


def hvd_face():
    """Horovod's TensorFlow API under Horovod's names (sdp.compat): static sets A and B through
    ``hvd.init(process_sets=...)``, then a dynamic set C = [0, 2] through ``hvd.add_process_set``."""
    import sdp.compat
    sdp.compat.install("horovod")
    import tensorflow as tf
    import horovod.tensorflow as hvd

    out = {}
    a, b = hvd.ProcessSet(A_RANKS), hvd.ProcessSet([3, 2, 1])
    hvd.init(process_sets=[a, b])
    hvd.init(process_sets=[a, b])  # Horovod: a second init() is a no-op
    try:
        hvd.add_process_set([0, 2])
        out["no_dynamic"] = None
    except ValueError as e:
        out["no_dynamic"] = str(e)
    os.environ["HOROVOD_DYNAMIC_PROCESS_SETS"] = "1"
    c = hvd.add_process_set([2, 0])
    out["c"] = [c.process_set_id, c.ranks]
    if c.included():
        out["c_sum"] = hvd.allreduce(tf.constant([1.0 + hvd.rank()]), op=hvd.Sum, process_set=c).numpy().tolist()
    out["removed"] = [hvd.remove_process_set(c), c.process_set_id, hvd.remove_process_set(hvd.global_process_set)]
    me = hvd.rank()
    out["ids"] = [a.process_set_id, b.process_set_id]
    out["b_ranks"] = b.ranks
    out["included"] = [a.included(), b.included(), hvd.global_process_set.included()]
    out["sizes"] = [a.size(), b.size(), hvd.global_process_set.size()]
    out["set_rank"] = [a.rank() if a.included() else None, b.rank() if b.included() else None]
    out["ops"] = [int(hvd.process_set_included_op(a.process_set_id)), int(hvd.size_op(b.process_set_id)),
                  int(hvd.size_op())]
    for ps, members in ((a, A_RANKS), (b, B_RANKS)):
        if not ps.included():
            try:
                hvd.allreduce(tf.ones([2]), process_set=ps)
                out[f"outsider{ps.process_set_id}"] = None
            except ValueError as e:
                out[f"outsider{ps.process_set_id}"] = str(e)
            continue
        k = ps.process_set_id
        x = tf.constant(_data(me, k, (6,)))
        out[f"avg{k}"] = np.allclose(hvd.allreduce(x, process_set=ps).numpy(),
                                     sum(_data(r, k, (6,)) for r in members) / len(members))

        @tf.function
        def graph_sum(t, ps=ps):
            return hvd.allreduce(t, op=hvd.Sum, process_set=ps), hvd.allgather(t, process_set=ps)

        s, g = graph_sum(x)
        out[f"fn_sum{k}"] = np.allclose(s.numpy(), sum(_data(r, k, (6,)) for r in members))
        out[f"fn_gather{k}"] = np.allclose(g.numpy(), np.concatenate([_data(r, k, (6,)) for r in members]))
        out[f"bcast{k}"] = np.allclose(hvd.broadcast(x, members[-1], process_set=ps).numpy(),
                                       _data(members[-1], k, (6,)))
        n, i = len(members), members.index(me)
        blocks = [np.split(_data(r, k, (6,)), n)[i] for r in members]
        out[f"a2a{k}"] = np.allclose(hvd.alltoall(x, process_set=ps).numpy(), np.concatenate(blocks))
        from sdp.engine.collectives import _bounds
        rows = _bounds(6, n)
        out[f"rs{k}"] = np.allclose(hvd.reducescatter(x, op=hvd.Sum, process_set=ps).numpy(),
                                    sum(_data(r, k, (6,)) for r in members)[rows[i]:rows[i + 1]])
        # DistributedGradientTape: loss = sum(w * x_rank) -> gradient x_rank, averaged over the set
        w = tf.Variable(tf.zeros([6]))
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(w * x)
        grad = hvd.DistributedGradientTape(tape, process_set=ps).gradient(loss, [w])[0]
        out[f"tape{k}"] = np.allclose(grad.numpy(), sum(_data(r, k, (6,)) for r in members) / len(members))
        v = tf.Variable(tf.fill([3], float(me)))
        hvd.broadcast_variables([v], root_rank=members[0], process_set=ps)
        out[f"bvars{k}"] = v.numpy().tolist() == [float(members[0])] * 3
        opt = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(1.0), process_set=ps)
        w2 = tf.Variable(tf.zeros([6]))
        opt.apply_gradients([(x, w2)])
        out[f"opt{k}"] = np.allclose(w2.numpy(), -sum(_data(r, k, (6,)) for r in members) / len(members))
    hvd.barrier()
    return out


def disjoint_sets():
    """Sets [0, 1] and [2, 3]: while set [0, 1] waits 2 s for rank 1, set [2, 3] runs 20
    allreduces.  Returns (seconds set [2, 3] took or None, seconds set [0, 1] took or None)."""
    import time
    from sdp import api
    me = api.rank()
    low, high = api.add_process_sets([[0, 1], [2, 3]])
    t0 = time.monotonic()
    if me in (0, 1):
        if me == 1:
            time.sleep(2.0)
        out = api.allreduce(np.ones(4), "slow", op=api.ReduceOp.SUM, process_set=low)
        assert out.tolist() == [2.0] * 4
        took = (None, time.monotonic() - t0)
    else:
        for i in range(20):
            out = api.allreduce(np.full(1000, me, np.float32), "fast", op=api.ReduceOp.SUM, process_set=high)
            assert out[0] == 5.0
        took = (time.monotonic() - t0, None)
    api.barrier()
    return took


def outsider_leaves_first():
    """3 ranks, set [0, 2]: rank 1 is outside it and shuts down at once; ranks 0 and 2 then run
    the set's collectives (rank 1's BYE has reached them by then).  Returns the set's results."""
    import time

    import sdp
    ps = sdp.api.add_process_sets([[0, 2]])[0]
    if sdp.rank() == 1:
        sdp.shutdown()
        return None
    time.sleep(0.5)
    got = sdp.allreduce(np.full(4, sdp.rank(), np.float32), name="after", op=sdp.Sum, process_set=ps)
    obj = sdp.broadcast_object({"from": sdp.rank()}, root_rank=2, process_set=ps)
    return [got.tolist(), obj]


def ids_after_reinit():
    """Process set ids count from 1 again after shutdown() and init() (every rank alike);
    returns the ids before and after and the set's allreduce after re-init."""
    import sdp
    before = sdp.api.add_process_sets([[0, 1]])[0]
    sdp.shutdown()
    sdp.init()
    after = sdp.api.add_process_sets([[0, 1]])[0]
    got = None
    if sdp.rank() < 2:
        got = sdp.allreduce(np.ones(2, np.float32), name="re", op=sdp.Sum, process_set=after).tolist()
    sdp.barrier()
    return [before, after, got]
