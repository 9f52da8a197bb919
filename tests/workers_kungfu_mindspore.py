"""Workers for tests/test_kungfu_mindspore.py: the KungFu fork's MindSpore names on sdp, in real
MindSpore processes (run by tests/harness.py or sdprun)."""
import numpy as np

DTYPES = ("float16", "float32", "float64", "int32", "int64")
SHAPES = ((), (5,), (2, 3))


def _setup(mode):
    import mindspore as ms
    import sdp_kungfu_bridge.mindspore as face
    assert face.install(), "the fork's names did not map to sdp"
    ms.set_context(mode=ms.GRAPH_MODE if mode == "graph" else ms.PYNATIVE_MODE)
    ms.set_device("CPU")
    return ms


def _data(rank, dtype, shape):
    rng = np.random.default_rng(1000 + 17 * rank + DTYPES.index(dtype))
    return (rng.integers(-8, 9, size=shape)).astype(dtype)


def ops_vs_numpy(mode):
    """Every op against numpy for every dtype and shape, inside a Cell (C.Map for allreduce) and
    eagerly.  Returns a list of mismatches (empty: all equal) and the cluster size the ops saw."""
    ms = _setup(mode)
    from mindspore import nn
    from mindspore.ops import composite as C
    import mindspore.ops.operations.kungfu_comm_ops as kfops
    from mindspore._c_expression import kungfu_current_cluster_size, kungfu_current_rank
    rank, size = kungfu_current_rank(), kungfu_current_cluster_size()

    class Reduce(nn.Cell):
        def __init__(self, op):
            super().__init__()
            self.map_ = C.Map()
            self.all_reduce = kfops.KungFuAllReduce(op)

        def construct(self, xs):
            return self.map_(self.all_reduce, xs)

    bad = []

    def check(what, got, want, dtype):
        got = got.asnumpy()
        tol = 1e-2 if dtype == "float16" else 1e-6
        if got.dtype != np.dtype(dtype) or got.shape != want.shape or \
                not np.allclose(got.astype(np.float64), want.astype(np.float64), rtol=tol, atol=tol):
            bad.append(f"{what} {dtype}{list(want.shape)}: got {got.dtype}{list(got.shape)} {got.ravel()[:4]}, "
                       f"want {want.ravel()[:4]}")

    for op, ref in (("sum", np.sum), ("max", np.max), ("min", np.min), ("prod", np.prod)):
        net = Reduce(op)
        for dtype in DTYPES:
            xs = tuple(ms.Tensor(_data(rank, dtype, s)) for s in SHAPES)
            every = [[_data(r, dtype, s) for s in SHAPES] for r in range(size)]
            outs = net(xs)
            for i, s in enumerate(SHAPES):
                want = ref(np.stack([every[r][i] for r in range(size)]).astype(np.float64), axis=0)
                check(f"allreduce({op})", outs[i], want.astype(dtype), dtype)
    gather, bcast = kfops.KungFuAllGather(), kfops.KungFuBroadcast()
    for dtype in DTYPES:
        for s in SHAPES:
            x = ms.Tensor(_data(rank, dtype, s))
            check("allgather", gather(x), np.stack([_data(r, dtype, s) for r in range(size)]), dtype)
            check("broadcast", bcast(x), _data(0, dtype, s), dtype)
            check("allreduce eager", kfops.KungFuAllReduce()(x),
                  np.sum([_data(r, dtype, s).astype(np.float64) for r in range(size)], axis=0).astype(dtype), dtype)
    grouped = kfops.KungFuGroupAllReduce(len(DTYPES))
    xs = [ms.Tensor(_data(rank, d, (3,))) for d in DTYPES]
    for d, y in zip(DTYPES, grouped(*xs)):
        check("group_all_reduce", y, np.sum([_data(r, d, (3,)).astype(np.float64) for r in range(size)],
                                            axis=0).astype(d), d)
    cluster = int(kfops.KungFuClusterSize()().asnumpy().ravel()[0])
    return {"bad": bad, "size": size, "op_size": cluster, "rank": rank, "using": kfops.using_kungfu()}


def _one_step_weights(cls_name, mode):
    """One optimizer step on a Dense(3, 1) with gradient 1 + rank everywhere (lr 0.1, no momentum)."""
    ms = _setup(mode)
    from mindspore import nn
    from mindspore.ops import composite as C
    from mindspore.ops.operations.kungfu_comm_ops import KungFuAllReduce
    import mindspore.nn.optim.kungfu as kfopt
    from mindspore._c_expression import kungfu_current_rank

    class GuideMomentum(ms.nn.Momentum):  # the guide's optimizer, as a user writes it
        def __init__(self, *args, **kwargs):
            super(GuideMomentum, self).__init__(*args, **kwargs)
            self.map_ = C.Map()
            self.all_reduce = KungFuAllReduce()

        def construct(self, gradients):
            gradients = self.map_(self.all_reduce, gradients)
            return super(GuideMomentum, self).construct(gradients)

    cls = GuideMomentum if cls_name == "guide" else getattr(kfopt, cls_name)
    net = nn.Dense(3, 1, weight_init="ones", bias_init="zeros")
    opt = cls(net.trainable_params(), 0.1, 0.0)
    g = float(1 + kungfu_current_rank())
    grads = (ms.Tensor(np.full((1, 3), g, np.float32)), ms.Tensor(np.full((1,), g, np.float32)))
    opt(grads)
    return [float(v) for v in net.weight.asnumpy().ravel()]


def optimizer_step(cls_name, mode):
    """:func:`_one_step_weights`, counting the engine's allreduce requests (each call of
    ``sdp.api.allreduce`` / ``grouped_allreduce``, which the ops look up at run time)."""
    from sdp import api
    counts = {"allreduce": 0, "grouped_allreduce": 0}
    for fn in counts:
        def counting(*a, _orig=getattr(api, fn), _fn=fn, **k):
            counts[_fn] += 1
            return _orig(*a, **k)
        setattr(api, fn, counting)
    weights = _one_step_weights(cls_name, mode)
    return {"weights": weights, "calls": counts}


def sync_then_train(how, mode):
    """Train a step (the optimizer compiles), then make the parameters rank 0's with the face's
    ``sync_net_parameters`` (``how="face"``) or the guide's ``param.set_data`` (``"guide"``),
    then train 3 more steps.  The optimizer is MindSpore's own ``nn.Momentum`` (its ``@jit`` update
    is what keeps the old storage; the face's optimizers update op by op in PYNATIVE mode).
    Returns the weights after the sync and after training."""
    ms = _setup(mode)
    from mindspore import nn
    import mindspore.ops.operations.kungfu_comm_ops as kfops
    from mindspore.train.callback._kungfu import sync_net_parameters
    from mindspore._c_expression import kungfu_current_rank
    rank = kungfu_current_rank()
    ms.set_seed(rank)
    net = nn.Dense(3, 1, weight_init="normal", bias_init="zeros")
    step = nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()), nn.Momentum(net.trainable_params(), 0.05, 0.0))
    x = ms.Tensor(np.ones((4, 3), np.float32))
    y = ms.Tensor(np.zeros((4, 1), np.float32))
    step(x, y)
    if how == "face":
        sync_net_parameters(net)
    else:
        broadcast = kfops.KungFuBroadcast()
        for _name, param in net.parameters_and_names():
            param.set_data(broadcast(ms.Tensor(param.data)))
    synced = [float(v) for v in net.weight.asnumpy().ravel()]
    for _ in range(3):
        step(x, y)
    return {"synced": synced, "trained": [float(v) for v in net.weight.asnumpy().ravel()]}
