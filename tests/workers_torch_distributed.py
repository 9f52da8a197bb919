"""Worker functions of tests/test_torch_distributed.py (the ``torch.distributed`` backend ``sdp``
and SMDDP's PyTorch names), run inside real rank processes by tests/harness.py."""
import hashlib
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

torch.set_num_threads(1)

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
          "float64": torch.float64, "int32": torch.int32, "int64": torch.int64, "uint8": torch.uint8}
OPS = {"SUM": dist.ReduceOp.SUM, "AVG": dist.ReduceOp.AVG, "MIN": dist.ReduceOp.MIN, "MAX": dist.ReduceOp.MAX,
       "PRODUCT": dist.ReduceOp.PRODUCT}


def _init(**kw):
    import sdp.torch.distributed  # noqa: F401  (registers "sdp")
    dist.init_process_group(backend="sdp", **kw)
    return dist.get_rank(), dist.get_world_size()


def _rank_values(r: int) -> torch.Tensor:
    return (torch.arange(6, dtype=torch.float64) + 1) * (r + 1)


def _reference(op: str, n: int) -> torch.Tensor:
    stack = torch.stack([_rank_values(r) for r in range(n)])
    return {"SUM": stack.sum(0), "AVG": stack.mean(0), "MIN": stack.min(0).values, "MAX": stack.max(0).values,
            "PRODUCT": stack.prod(0)}[op]


def collectives():
    """Every collective of the process group against a reference computed here.  Returns
    {check: bool}."""
    r, n = _init()
    assert dist.get_backend() == "sdp"
    ok = {}
    for dname, dt in DTYPES.items():
        for op in OPS:
            if op == "AVG" and not dt.is_floating_point:
                continue
            t = _rank_values(r).to(dt)
            dist.all_reduce(t, op=OPS[op])
            ok[f"all_reduce {dname} {op}"] = torch.equal(t, _reference(op, n).to(dt))
    # in place in the caller's memory, and a non-contiguous tensor (copied in)
    t = _rank_values(r).float()
    ptr = t.data_ptr()
    dist.all_reduce(t)
    ok["all_reduce in place"] = t.data_ptr() == ptr and torch.equal(t, _reference("SUM", n).float())
    t = _rank_values(r).float().reshape(2, 3).t()
    dist.all_reduce(t)
    ok["all_reduce non-contiguous"] = torch.equal(t, _reference("SUM", n).float().reshape(2, 3).t())
    # async: Work.wait() and the future DDP's comm hooks chain
    works = [dist.all_reduce(torch.full((4,), float(r + i)), async_op=True) for i in range(3)]
    futs = [w.get_future().then(lambda f: f.value()[0] * 2) for w in works[:2]]
    works[2].wait()
    want = [2 * (n * i + n * (n - 1) / 2) for i in range(2)]
    ok["async futures"] = [f.wait()[0].item() for f in futs] == want and works[0].is_completed()
    # broadcast from the last rank
    b = torch.full((3, 2), float(r))
    dist.broadcast(b, n - 1)
    ok["broadcast"] = torch.equal(b, torch.full((3, 2), float(n - 1)))
    outs = [torch.zeros(2, 2, dtype=torch.bfloat16) for _ in range(n)]
    dist.all_gather(outs, torch.full((2, 2), float(r), dtype=torch.bfloat16))
    ok["all_gather"] = all(torch.equal(o, torch.full((2, 2), float(i), dtype=torch.bfloat16))
                           for i, o in enumerate(outs))
    o = torch.zeros(n, 3)
    dist.all_gather_into_tensor(o, torch.full((3,), float(r)))
    ok["all_gather_into_tensor"] = torch.equal(o, torch.arange(n, dtype=torch.float32)[:, None].expand(n, 3))
    o = torch.zeros(2, dtype=torch.int64)
    dist.reduce_scatter_tensor(o, torch.arange(2 * n) * (r + 1))
    ok["reduce_scatter_tensor"] = torch.equal(o, torch.arange(2 * r, 2 * r + 2) * (n * (n + 1) // 2))
    o = torch.zeros(2)
    dist.reduce_scatter(o, [torch.full((2,), float(i + r)) for i in range(n)], op=dist.ReduceOp.MAX)
    ok["reduce_scatter max"] = torch.equal(o, torch.full((2,), float(r + n - 1)))
    o = torch.zeros(n)
    dist.all_to_all_single(o, torch.arange(n, dtype=torch.float32) + 10 * r)
    ok["all_to_all_single"] = torch.equal(o, torch.arange(n, dtype=torch.float32) * 10 + r)
    outs = [torch.zeros(i + 1) for i in range(n)]
    dist.all_to_all(outs, [torch.full((r + 1,), float(r * 10 + j)) for j in range(n)])
    ok["all_to_all"] = all(torch.equal(x, torch.full((i + 1,), float(i * 10 + r))) for i, x in enumerate(outs))
    t = torch.full((2,), float(r + 1))
    dist.reduce(t, 0, op=dist.ReduceOp.PRODUCT)
    ok["reduce"] = torch.equal(t, torch.full((2,), float(torch.arange(1, n + 1).prod())) if r == 0
                               else torch.full((2,), float(r + 1)))
    got = [torch.zeros(2) for _ in range(n)] if r == 1 else None
    dist.gather(torch.full((2,), float(r)), got, dst=1)
    ok["gather"] = r != 1 or all(torch.equal(g, torch.full((2,), float(i))) for i, g in enumerate(got))
    s = torch.zeros(3)
    dist.scatter(s, [torch.full((3,), float(i * 7)) for i in range(n)] if r == 0 else None, src=0)
    ok["scatter"] = torch.equal(s, torch.full((3,), float(r * 7)))
    objs = [None] * n
    dist.all_gather_object(objs, {"rank": r})
    ok["all_gather_object"] = objs == [{"rank": i} for i in range(n)]
    lst = [{"from": r}]
    dist.broadcast_object_list(lst, src=0)
    ok["broadcast_object_list"] = lst == [{"from": 0}]
    # point to point around the ring: isend/irecv (a bfloat16 and a strided tensor), send/recv
    nxt, prv = (r + 1) % n, (r - 1) % n
    got_b, got_s = torch.zeros(3, dtype=torch.bfloat16), torch.zeros(3, 2).t()
    works = [dist.irecv(got_b, src=prv, tag=1), dist.irecv(got_s, src=prv, tag=2),
             dist.isend(torch.full((3,), float(r), dtype=torch.bfloat16), dst=nxt, tag=1),
             dist.isend(torch.arange(6.0).reshape(2, 3) + r, dst=nxt, tag=2)]
    for w in works:
        w.wait()
    ok["isend/irecv"] = (torch.equal(got_b, torch.full((3,), float(prv), dtype=torch.bfloat16))
                         and torch.equal(got_s, torch.arange(6.0).reshape(2, 3) + prv))
    got = torch.zeros(4, dtype=torch.int64)
    if r % 2 == 0:
        dist.send(torch.arange(4) * (r + 1), dst=nxt)
        dist.recv(got, src=prv)
    else:
        dist.recv(got, src=prv)
        dist.send(torch.arange(4) * (r + 1), dst=nxt)
    ok["send/recv"] = torch.equal(got, torch.arange(4) * (prv + 1))
    dist.barrier()
    group = dist.new_group(list(range(n)))
    t = torch.ones(2)
    dist.all_reduce(t, group=group)
    ok["new_group of every rank"] = torch.equal(t, torch.full((2,), float(n)))
    sub = [0, 2] if n >= 3 else [1]  # (an sdp process set; the other ranks are no members)
    group = dist.new_group(sub)
    if r in sub:
        t = torch.full((2,), float(r + 1))
        dist.all_reduce(t, group=group)
        b = torch.full((1,), float(r))
        dist.broadcast(b, src=sub[-1], group=group)  # (a job rank; the group's rank len(sub) - 1)
        outs = [torch.zeros(1) for _ in sub]
        dist.all_gather(outs, torch.full((1,), float(r)), group=group)
        ok["subgroup"] = (torch.equal(t, torch.full((2,), float(sum(s + 1 for s in sub))))
                          and b.item() == sub[-1] and [o.item() for o in outs] == [float(s) for s in sub]
                          and (dist.get_rank(group), dist.get_world_size(group)) == (sub.index(r), len(sub)))
    else:
        ok["subgroup"] = group == dist.GroupMember.NON_GROUP_MEMBER
    again = dist.new_group(sub)  # (the same ranks again: the same process set)
    if r in sub:
        t = torch.ones(1)
        dist.all_reduce(t, group=again)
        ok["subgroup again"] = t.item() == len(sub)
    dist.barrier()  # (a set's collectives are negotiated by rank 0, also when it is no member)
    try:
        dist.all_reduce(torch.ones(2, dtype=torch.int32), op=dist.ReduceOp.BAND)
        ok["BAND raises"] = False
    except ValueError as e:
        ok["BAND raises"] = "BAND" in str(e)
    dist.destroy_process_group()
    return ok


def _cnn():
    return torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.ReLU(), torch.nn.MaxPool2d(2), torch.nn.Flatten(),
                               torch.nn.Linear(4 * 5 * 5, 10))


def _digest(model) -> str:
    return hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()[:16]


def _train(group, r: int, steps: int) -> list:
    torch.manual_seed(1234)  # every rank builds the same model (DDP broadcasts rank 0's anyway)
    model = _cnn()
    start = _digest(model)
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=group, bucket_cap_mb=0.002)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(100 + r)  # each rank its own batches
    for _ in range(steps):
        x, y = torch.randn(8, 1, 12, 12, generator=gen), torch.randint(0, 10, (8,), generator=gen)
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
    return [start, _digest(model)]


def ddp_sdp_and_gloo(store_file: str, steps: int):
    """DDP on the sdp backend, then the same seeded run on a Gloo group of the same job (the
    default group's store is a file; Gloo on loopback).  Returns [[start, end] sdp, [start, end]
    gloo]."""
    from sdp.common import topology
    topo = topology.from_env()
    r, n = _init(init_method=f"file://{store_file}", rank=topo.rank, world_size=topo.size)
    gloo = dist.new_group(backend="gloo")
    from sdp.torch.distributed import ProcessGroupSDP
    assert dist.get_backend(gloo) == "gloo" and not isinstance(gloo, ProcessGroupSDP), gloo  # (Gloo's own)
    out = [_train(None, r, steps), _train(gloo, r, steps)]
    dist.destroy_process_group()
    return out


def ddp_modes(steps: int):
    """DDP's modes and comm hooks on the sdp backend (PowerSGD's hook waits on a collective inside
    a future's callback; ``join()`` shadows the collectives of a rank out of inputs).  Returns
    {mode: the sum of the weights after training}, to be equal on every rank."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    r, n = _init()
    out = {}
    for mode in ("plain", "fp16 hook", "PowerSGD hook", "find_unused_parameters", "static_graph",
                 "gradient_as_bucket_view", "join"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(20, 30), torch.nn.ReLU(), torch.nn.Linear(30, 5))
        kw = {m: True for m in ("find_unused_parameters", "static_graph", "gradient_as_bucket_view") if m == mode}
        ddp = torch.nn.parallel.DistributedDataParallel(model, **kw)
        if mode == "fp16 hook":
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        if mode == "PowerSGD hook":
            ddp.register_comm_hook(powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=1,
                                                               start_powerSGD_iter=2), powerSGD_hook.powerSGD_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(r)
        with ddp.join(enable=mode == "join"):
            for _ in range(steps + (r if mode == "join" else 0)):  # (join: uneven inputs)
                opt.zero_grad()
                ddp(torch.randn(4, 20, generator=gen)).square().mean().backward()
                opt.step()
        out[mode] = sum(p.double().sum().item() for p in model.parameters())
    dist.destroy_process_group()
    return out


def mismatches():
    """Each rank passes what another does not: every rank must raise (which exception, what it
    says), and the group must work afterwards."""
    r, n = _init()
    out = {}

    def attempt(key, fn):
        try:
            fn()
            out[key] = None
        except Exception as e:  # noqa: BLE001
            out[key] = [type(e).__name__, str(e)]

    attempt("shape", lambda: dist.all_reduce(torch.ones(3 + r)))
    attempt("kind", lambda: dist.all_reduce(torch.ones(2)) if r == 0 else dist.broadcast(torch.ones(2), 0))
    attempt("dtype", lambda: dist.all_reduce(torch.ones(2, dtype=torch.float32 if r else torch.float64)))
    attempt("future", lambda: dist.all_reduce(torch.ones(4, 1 + r), async_op=True).get_future().wait())
    t = torch.ones(2)
    dist.all_reduce(t)
    out["after"] = t.tolist()
    dist.destroy_process_group()
    return out


def smddp_names():
    """SMDDP's PyTorch modules under --compat smdistributed."""
    import smdistributed.dataparallel.torch.distributed as sdist
    from smdistributed.dataparallel.torch.parallel.distributed import DistributedDataParallel as DDP
    import smdistributed.dataparallel.torch.parallel as parallel
    import sdp.compat_smddp.torch.distributed

    out = {"same module": sdist is sdp.compat_smddp.torch.distributed,
           "ddp class": parallel.DistributedDataParallel is DDP,
           "before init": sdist.is_initialized(), "available": sdist.is_available()}
    sdist.init_process_group()
    r, n = sdist.get_rank(), sdist.get_world_size()
    out.update({"initialized": sdist.is_initialized(), "rank": r, "size": n, "local rank": sdist.get_local_rank()})
    t = torch.full((3,), float(r + 1))
    sdist.all_reduce(t, op=sdist.ReduceOp.AVERAGE)
    out["average"] = t.tolist()
    t = torch.full((2,), float(r))
    sdist.all_reduce(t)  # SUM by default
    out["sum"] = t.tolist()
    t = torch.full((2,), float(r))
    sdist.broadcast(t, src=n - 1, async_op=True).wait()
    out["broadcast"] = t.tolist()
    outs = [torch.zeros(1) for _ in range(n)]
    sdist.all_gather(outs, torch.full((1,), float(r)))
    out["all_gather"] = [o.item() for o in outs]
    sdist.barrier()
    try:
        sdist.all_reduce(t, group=object())
        out["group raises"] = False
    except ValueError:
        out["group raises"] = True
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(3, 1, bias=False))
    model(torch.full((2, 3), float(r + 1))).sum().backward()
    out["ddp grad"] = model.module.weight.grad.tolist()  # the average of 2 * (r + 1) over ranks
    dist.destroy_process_group()
    # SMDDP v1.4+: torch.distributed with backend "smddp" after importing torch_smddp
    import smdistributed.dataparallel.torch.torch_smddp  # noqa: F401
    dist.init_process_group(backend="smddp")
    t = torch.ones(2)
    dist.all_reduce(t)
    out["smddp backend"] = [dist.get_backend(), t.tolist(), os.environ.get("LOCAL_RANK")]
    dist.destroy_process_group()
    return out


def kungfu_torch():
    """kungfu.torch's ops and SynchronousSGDOptimizer under --compat kungfu."""
    import kungfu.torch as kf
    from kungfu.python import current_rank
    from kungfu.torch.optimizers import SynchronousSGDOptimizer
    r, out = current_rank(), {}
    x = torch.full((3,), float(r + 1))
    out["all_reduce_fn"] = [kf.ops.all_reduce_fn(x).tolist(), kf.ops.all_reduce_fn(x, op="max").tolist(),
                            x.tolist() == [float(r + 1)] * 3]
    kf.ops.inplace_all_reduce_op(x)
    h = kf.ops.inplace_all_reduce_async_op(x, "kf.test", op="prod")
    kf.ops.wait_handle(h)
    out["in place"] = x.tolist()
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    start = model.bias.item()
    opt = SynchronousSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
    for _ in range(2):
        opt.zero_grad()
        model(torch.full((2, 3), float(r + 1))).sum().backward()
        opt.step()
    out["optimizer"] = [isinstance(opt, torch.optim.SGD), model.bias.item() - start]
    return out


def benchmark_table():
    """benchmarks/torch_allreduce.py's main() at 1 KB, one round; returns [exit status, what it
    printed] (rank 0 prints the table)."""
    import contextlib
    import io
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    import torch_allreduce
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = torch_allreduce.main(["--sizes", "1K", "--rounds", "1", "--ddp-steps", "2"])
    return [rc, buf.getvalue()]


def launched_like_kubeflow():
    """``init_process_group(backend="sdp")`` with a launcher's ``RANK``/``WORLD_SIZE``/
    ``MASTER_ADDR``/``MASTER_PORT`` and no sdprun: PyTorch's TCPStore holds ``MASTER_PORT``,
    sdp meets beside it.  Returns [sdp's topology source, an allreduce's result]."""
    import sdp
    r, n = _init()
    t = torch.full((2,), float(r + 1))
    dist.all_reduce(t)
    out = [sdp.api.runtime().topology.source, t.tolist()]
    dist.destroy_process_group()
    return out
