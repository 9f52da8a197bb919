"""Worker functions of tests/test_torch.py (and the torch tests of tests/test_gpu.py), run inside
real rank processes by tests/harness.py.  Each returns the list of what went wrong (empty: all
good), so one launch checks many things and a failure names each of them."""
import numpy as np
import torch

import sdp
import sdp.torch as hvd
from sdp.torch import tensors

TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
                "float64": torch.float64, "int32": torch.int32, "int64": torch.int64}


def adapter_allreduce(dtypes):
    """Each dtype: an allreduce (Sum) through the adapter, and one written into the caller's own
    tensor (``out=`` its numpy view).  Returns [[dtype, equal, in place, same memory], ...]."""
    out, r, n = [], sdp.rank(), sdp.size()
    for name in dtypes:
        dt = TORCH_DTYPES[name]
        t = (torch.arange(12, dtype=torch.float64).reshape(3, 4) * (r + 1)).to(dt)
        want = (torch.arange(12, dtype=torch.float64).reshape(3, 4) * (n * (n + 1) // 2)).to(dt)
        got = tensors.as_tensor(sdp.allreduce(tensors.as_input(t), name=f"a.{name}", op=sdp.Sum))
        mine = t.clone()
        view = tensors.out_array(mine)
        res = sdp.allreduce(view, name=f"b.{name}", op=sdp.Sum, out=view)
        same = tensors.copy_into(mine, res) is mine and np.shares_memory(res, view)
        out.append([name, bool(got.dtype == dt and torch.equal(got, want)), bool(torch.equal(mine, want)), bool(same)])
    return out


class _Checks(list):
    device = "cpu"  # where results must be

    def eq(self, what, got, want):
        """``got`` equals ``want`` (dtype, device, values; floats within 16-bit rounding)."""
        if not isinstance(got, torch.Tensor):
            self.append(f"{what}: got {type(got).__name__}")
            return
        want = torch.as_tensor(want).to(got.device)
        if got.device.type != self.device and not what.endswith("splits"):
            self.append(f"{what}: on {got.device}, not {self.device}")
        elif got.shape != want.shape or got.dtype != want.dtype:
            self.append(f"{what}: {got.dtype}{tuple(got.shape)} != {want.dtype}{tuple(want.shape)}")
        elif not torch.allclose(got.double().cpu(), want.double().cpu(), rtol=1e-2 if got.element_size() == 2
                                else 1e-6, atol=1e-6):
            self.append(f"{what}: {got.flatten()[:6].tolist()} != {want.flatten()[:6].tolist()}")

    def true(self, what, cond):
        if not cond:
            self.append(what)


def collectives(dtypes, device="cpu"):
    """Every collective of sdp.torch on every dtype of ``dtypes``: out of place, in place, async
    with poll/synchronize, grouped; values against what they must be at this size."""
    hvd.init()  # (already initialized by the harness: Horovod's rule makes this a no-op)
    c, r, n = _Checks(), hvd.rank(), hvd.size()
    c.device = device
    tri = n * (n + 1) // 2
    for name in dtypes:
        dt = TORCH_DTYPES[name]

        def mk(*shape, scale=1):
            return (torch.arange(int(np.prod(shape)), dtype=torch.float64).reshape(shape) * scale).to(dt).to(device)
        x = mk(2, 3) + (r + 1)
        s = mk(2, 3) * n + tri  # Sum
        c.eq(f"{name} allreduce Sum", hvd.allreduce(x, op=hvd.Sum), s)
        c.eq(f"{name} allreduce Max", hvd.allreduce(x, op=hvd.Max), mk(2, 3) + n)
        c.eq(f"{name} allreduce Min", hvd.allreduce(x, op=hvd.Min), mk(2, 3) + 1)
        c.eq(f"{name} scaled Sum", hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5), s)
        if dt.is_floating_point:
            c.eq(f"{name} allreduce (Average)", hvd.allreduce(x), mk(2, 3) + (n + 1) / 2)
            c.eq(f"{name} fp16 compression", hvd.allreduce(x, op=hvd.Sum, compression=hvd.Compression.fp16), s)
        y = x.clone()
        c.true(f"{name} allreduce_ returns the caller's tensor", hvd.allreduce_(y, op=hvd.Sum) is y)
        c.eq(f"{name} allreduce_", y, s)
        h = hvd.allreduce_async(x, op=hvd.Sum, name=f"t.{name}.async")
        c.true(f"{name} handle is an int", isinstance(h, int))
        c.eq(f"{name} allreduce_async", hvd.synchronize(h), s)
        y = x.clone()
        h = hvd.allreduce_async_(y, op=hvd.Sum)
        while not hvd.poll(h):
            pass
        c.true(f"{name} allreduce_async_ returns the caller's tensor", hvd.synchronize(h) is y)
        c.eq(f"{name} allreduce_async_", y, s)
        xs = [x, mk(4) + r, mk(1, 2, 2) * 0 + r]
        sums = [s, mk(4) * n + n * (n - 1) // 2, mk(1, 2, 2) * 0 + n * (n - 1) // 2]
        for i, (g, w) in enumerate(zip(hvd.grouped_allreduce(xs, op=hvd.Sum), sums)):
            c.eq(f"{name} grouped_allreduce[{i}]", g, w)
        ys = [t.clone() for t in xs]
        got = hvd.synchronize(hvd.grouped_allreduce_async_(ys, op=hvd.Sum, name=f"g.{name}"))
        c.true(f"{name} grouped_allreduce_async_ returns the caller's tensors", all(a is b for a, b in zip(got, ys)))
        for i, (g, w) in enumerate(zip(ys, sums)):
            c.eq(f"{name} grouped_allreduce_async_[{i}]", g, w)
        ys = [t.clone() for t in xs]
        c.true(f"{name} grouped_allreduce_", all(a is b for a, b in zip(hvd.grouped_allreduce_(ys, op=hvd.Sum), ys)))
        c.eq(f"{name} grouped_allreduce_[1]", ys[1], sums[1])
        c.eq(f"{name} grouped_allreduce_async", hvd.synchronize(hvd.grouped_allreduce_async(xs, op=hvd.Max))[0],
             mk(2, 3) + n)
        # allgather: rank q holds q + 1 rows of value q
        rows = mk(r + 1, 2) * 0 + r
        want = torch.cat([mk(q + 1, 2) * 0 + q for q in range(n)])
        c.eq(f"{name} allgather", hvd.allgather(rows), want)
        c.eq(f"{name} allgather_async", hvd.synchronize(hvd.allgather_async(rows)), want)
        ga = hvd.grouped_allgather([rows, mk(1) + r])
        c.eq(f"{name} grouped_allgather[0]", ga[0], want)
        c.eq(f"{name} grouped_allgather[1]", ga[1], torch.cat([mk(1) + q for q in range(n)]))
        c.eq(f"{name} grouped_allgather_async", hvd.synchronize(hvd.grouped_allgather_async([rows]))[0], want)
        # broadcast from the last rank
        root = n - 1
        c.eq(f"{name} broadcast", hvd.broadcast(x, root), mk(2, 3) + n)
        y = x.clone()
        c.true(f"{name} broadcast_ returns the caller's tensor", hvd.broadcast_(y, root) is y)
        c.eq(f"{name} broadcast_", y, mk(2, 3) + n)
        c.eq(f"{name} broadcast_async", hvd.synchronize(hvd.broadcast_async(x, root)), mk(2, 3) + n)
        y = x.clone()
        c.true(f"{name} broadcast_async_", hvd.synchronize(hvd.broadcast_async_(y, root)) is y)
        # alltoall: rank r sends j + 1 rows of value 10 r + j to rank j
        send = torch.cat([mk(j + 1, 2) * 0 + (10 * r + j) for j in range(n)])
        out, got_splits = hvd.alltoall(send, splits=[j + 1 for j in range(n)])
        c.eq(f"{name} alltoall", out, torch.cat([mk(r + 1, 2) * 0 + (10 * q + r) for q in range(n)]))
        c.eq(f"{name} alltoall received splits", got_splits, torch.full((n,), r + 1, dtype=torch.int32))
        even = torch.cat([mk(1, 2) * 0 + (10 * r + j) for j in range(n)])
        c.eq(f"{name} alltoall (equal split)", hvd.alltoall(even), torch.cat([mk(1, 2) * 0 + (10 * q + r)
                                                                             for q in range(n)]))
        out, _ = hvd.synchronize(hvd.alltoall_async(even))
        c.eq(f"{name} alltoall_async", out, torch.cat([mk(1, 2) * 0 + (10 * q + r) for q in range(n)]))
        # reducescatter of 2n + 1 rows: rank r gets its block (lower ranks one row more)
        big = mk(2 * n + 1, 2) + r
        lo = sum(2 + (q < 1) for q in range(r))
        mine = 2 + (r < 1)
        want = (mk(2 * n + 1, 2) * n + n * (n - 1) // 2)[lo:lo + mine]
        c.eq(f"{name} reducescatter Sum", hvd.reducescatter(big, op=hvd.Sum), want)
        c.eq(f"{name} reducescatter_async", hvd.synchronize(hvd.reducescatter_async(big, op=hvd.Sum)), want)
        c.eq(f"{name} grouped_reducescatter", hvd.grouped_reducescatter([big, big], op=hvd.Sum)[1], want)
        c.eq(f"{name} grouped_reducescatter_async",
             hvd.synchronize(hvd.grouped_reducescatter_async([big], op=hvd.Sum))[0], want)
        if dt.is_floating_point:
            c.eq(f"{name} reducescatter (Average)", hvd.reducescatter(big), want / n)
    if n in (1, 2):  # Adasum (the engine's): orthogonal vectors add up, equal ones stay
        c.eq("Adasum of orthogonal vectors", hvd.allreduce(torch.eye(2, device=device)[r], op=hvd.Adasum),
             torch.ones(2) if n == 2 else torch.tensor([1.0, 0.0]))
        c.eq("Adasum of equal vectors", hvd.allreduce(torch.full((3,), 2.0, device=device), op=hvd.Adasum),
             torch.full((3,), 2.0))
    hvd.barrier()
    c.true("join returns a rank", hvd.join() in range(n))
    return list(c)


def named_allreduce(dtypes):
    """A named allreduce called again and again (its first call teaches the compiled entry, the
    next ones enter it from ``sdp.torch.allreduce`` through ``sdp.api.allreduce_front``): every
    result exact, a new tensor of the input's dtype and shape that keeps its values after later
    calls; Average with a postscale, a strided input and a tensor that requires a gradient under
    ``torch.no_grad()`` on the same names.  Returns [problems, calls the compiled entry took,
    whether there is one]."""
    from workers_lane import _counting
    c, r, n = _Checks(), hvd.rank(), hvd.size()
    rt = sdp.api.runtime()
    has_front = rt.front is not None
    entered = _counting(rt, "front") if has_front else [0]
    tri = n * (n + 1) // 2
    for name in dtypes:
        dt = TORCH_DTYPES[name]
        base = torch.arange(12, dtype=torch.float64).reshape(3, 4)
        kept = []
        for i in range(4):
            x = (base + (r + 1) * (i + 1)).to(dt)
            got = hvd.allreduce(x, name=f"n.{name}", op=hvd.Sum)
            c.true(f"{name} call {i}: a new tensor", got.data_ptr() != x.data_ptr())
            kept.append((got, (base * n + tri * (i + 1)).to(dt)))
        for i, (got, want) in enumerate(kept):  # (each after every later call)
            c.eq(f"{name} named Sum, call {i}", got, want)
        if dt.is_floating_point:
            for i in range(3):
                x = (base + (r + 1)).to(dt)
                c.eq(f"{name} named Average x 0.5, call {i}",
                     hvd.allreduce(x, name=f"n.{name}.avg", postscale_factor=0.5), ((base + (n + 1) / 2) * 0.5).to(dt))
        for i in range(2):  # (a strided view: never the compiled entry's, exact all the same)
            strided = (base + (r + 1)).to(dt).t()
            c.eq(f"{name} strided input, call {i}", hvd.allreduce(strided, name=f"n.{name}.t", op=hvd.Sum),
                 (base * n + tri).to(dt).t())
        if dt.is_floating_point:  # (a lazily negated view: numpy() refuses it, the values are -x)
            neg = torch._neg_view((base + (r + 1)).to(dt))
            c.eq(f"{name} negative-bit view", hvd.allreduce(neg, name=f"n.{name}", op=hvd.Sum),
                 (-(base * n + tri)).to(dt))
            with torch.no_grad():
                x = (base + (r + 1)).to(dt).requires_grad_()
                c.eq(f"{name} requires_grad under no_grad", hvd.allreduce(x, name=f"n.{name}", op=hvd.Sum),
                     (base * n + tri).to(dt))
    return [list(c), entered[0], has_front]


def gradients(dtypes, device="cpu"):
    """Autograd through every collective, Horovod's gradients (see sdp.torch.mpi_ops)."""
    c, r, n = _Checks(), hvd.rank(), hvd.size()
    c.device = device
    mean_w = (n + 1) / 2  # the average of r + 1 over the ranks
    for name in dtypes:
        dt = TORCH_DTYPES[name]

        def leaf(*shape, fill=1.0):
            return torch.full(shape, fill, dtype=dt, device=device, requires_grad=True)
        x = leaf(2, 3)
        (hvd.allreduce(x) * (r + 1)).sum().backward()
        c.eq(f"{name} grad allreduce (Average)", x.grad, torch.full((2, 3), mean_w, dtype=dt))
        x = leaf(2, 3)
        (hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0) * (r + 1)).sum().backward()
        c.eq(f"{name} grad allreduce Sum x2", x.grad, torch.full((2, 3), 2.0 * n * mean_w, dtype=dt))
        xs = [leaf(2), leaf(3)]
        sum(t.sum() * (r + 1) for t in hvd.grouped_allreduce(xs, op=hvd.Sum)).backward()
        c.eq(f"{name} grad grouped_allreduce Sum", xs[1].grad, torch.full((3,), n * mean_w, dtype=dt))
        x = leaf(r + 1, 2)
        (hvd.allgather(x) * (r + 1)).sum().backward()
        c.eq(f"{name} grad allgather", x.grad, torch.full((r + 1, 2), mean_w, dtype=dt))
        xs = [leaf(r + 1, 2), leaf(1)]
        sum(t.sum() * (r + 1) for t in hvd.grouped_allgather(xs)).backward()
        c.eq(f"{name} grad grouped_allgather", xs[0].grad, torch.full((r + 1, 2), mean_w, dtype=dt))
        x = leaf(3)
        (hvd.broadcast(x, 0) * (r + 1)).sum().backward()
        c.eq(f"{name} grad broadcast", x.grad, torch.full((3,), mean_w if r == 0 else 0.0, dtype=dt))
        x = leaf(sum(j + 1 for j in range(n)), 2)
        out, _ = hvd.alltoall(x, splits=[j + 1 for j in range(n)])
        (out * (r + 1)).sum().backward()
        c.eq(f"{name} grad alltoall", x.grad, torch.cat([torch.full((j + 1, 2), j + 1.0, dtype=dt)
                                                         for j in range(n)]))
        x = leaf(2 * n, 2)
        (hvd.reducescatter(x, op=hvd.Sum) * (r + 1)).sum().backward()
        c.eq(f"{name} grad reducescatter Sum", x.grad, torch.cat([torch.full((2, 2), n * (j + 1.0), dtype=dt)
                                                                  for j in range(n)]))
        xs = [leaf(2 * n, 2)]
        (hvd.grouped_reducescatter(xs)[0] * (r + 1)).sum().backward()
        c.eq(f"{name} grad grouped_reducescatter", xs[0].grad, torch.cat([torch.full((2, 2), j + 1.0, dtype=dt)
                                                                          for j in range(n)]))
    return list(c)


def process_set_and_errors():
    """A process set of ranks 0 and 2 (3 ranks), then mismatches: each rank returns the classes of
    what every failed collective raised, then proves the job still works."""
    c, r = _Checks(), hvd.rank()
    ps = hvd.add_process_set([0, 2])
    if r in (0, 2):
        c.eq("allreduce on a process set", hvd.allreduce(torch.tensor([r + 1.0]), op=hvd.Sum, process_set=ps),
             torch.tensor([4.0]))
        c.eq("broadcast on a process set", hvd.broadcast(torch.tensor([r]), 2, process_set=ps), torch.tensor([2]))
    errors = []
    for what, call in [
            ("shape", lambda: hvd.allreduce(torch.ones(r + 1), name="bad.shape")),
            ("dtype", lambda: hvd.synchronize(hvd.allreduce_async(torch.ones(2, dtype=torch.float32 if r else
                                                                                 torch.float64), name="bad.dtype"))),
            ("root", lambda: hvd.broadcast(torch.ones(2), r, name="bad.root"))]:
        try:
            call()
            errors.append([what, None, False, ""])
        except Exception as e:  # noqa: BLE001 - the class is what is checked
            errors.append([what, type(e).__name__, isinstance(e, hvd.HorovodInternalError), str(e)])
    c.eq("after the errors", hvd.allreduce(torch.ones(2), op=hvd.Sum), torch.full((2,), float(hvd.size())))
    hvd.remove_process_set(ps)
    return [list(c), errors]


def _model(seed=0, device="cpu"):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1)).double().to(device)


def _batches(step, n, passes, per=4, device="cpu"):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(n * passes * per, 4, generator=g, dtype=torch.float64)
    return x.to(device), x.sum(1, keepdim=True).sin().to(device)


def optimizer_passes(passes=2, steps=3, groups=None, device="cpu"):
    """DistributedOptimizer (SGD with momentum) with ``backward_passes_per_step=passes`` against
    one process on the concatenated batches; returns [problems, max abs weight difference]."""
    c, r, n = _Checks(), hvd.rank(), hvd.size()
    model = _model(seed=r, device=device)  # different on every rank until broadcast
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(), backward_passes_per_step=passes,
                                   groups=groups)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    ref = _model(seed=0, device=device)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        x, y = _batches(step, n, passes, device=device)
        opt.zero_grad()
        for k in range(passes):
            part = slice((r * passes + k) * 4, (r * passes + k + 1) * 4)
            (torch.nn.functional.mse_loss(model(x[part]), y[part]) / passes).backward()
            started = [h is not None for h, _ in opt._handles.values()]
            if k < passes - 1:
                c.true(f"step {step} pass {k}: no allreduce before the last pass", not any(started))
            else:
                c.true(f"step {step}: every allreduce started during backward()",
                       len(started) == (len(groups) if isinstance(groups, list) else groups or 4) and all(started))
        opt.step()
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
    diff = max(float((a - b).abs().max()) for a, b in zip(model.parameters(), ref.parameters()))
    return [list(c), diff]


def optimizer_checks():
    """Horovod's argument checks of DistributedOptimizer, and synchronize()/skip_synchronize()."""
    c, model = _Checks(), _model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    named = list(model.named_parameters())
    for what, kw, msg in [("duplicate names", dict(named_parameters=[("a", p) for _, p in named]), "unique"),
                          ("unnamed", dict(named_parameters=named[:1]), "were not named"),
                          ("not tuples", dict(named_parameters=[p for _, p in named]), "sequence of tuples"),
                          ("passes", dict(backward_passes_per_step=0), "must be > 0")]:
        try:
            hvd.DistributedOptimizer(sgd, **kw)
            c.append(f"{what}: no error")
        except ValueError as e:
            c.true(f"{what}: {e}", msg in str(e))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=named)
    c.true("a subclass of the wrapped class", isinstance(opt, torch.optim.SGD))
    model(torch.ones(2, 4, dtype=torch.float64)).sum().backward()
    try:
        opt.zero_grad()
        c.append("zero_grad while allreduces are in flight: no error")
    except AssertionError:
        pass
    opt.synchronize()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    with opt.skip_synchronize():
        opt.step()
    opt.zero_grad()
    return list(c)


def optimizer_state():
    """broadcast_optimizer_state for SGD with momentum and Adam whose states differ per rank
    (step counts, moments, learning rates); returns [problems, checksums after]."""
    c, r = _Checks(), hvd.rank()
    sums = {}
    for kind in ("sgd", "adam"):
        model = _model(seed=r)
        opt = (torch.optim.SGD(model.parameters(), lr=0.1 * (r + 1), momentum=0.9) if kind == "sgd"
               else torch.optim.Adam(model.parameters(), lr=0.01 * (r + 1)))
        for step in range(r + 1):  # rank r takes r + 1 steps on its own data
            x, y = _batches(10 * r + step, 1, 1)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        before = {k: {n: v.clone() if torch.is_tensor(v) else v for n, v in s.items()}
                  for k, s in opt.state_dict()["state"].items()}
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        root = hvd.broadcast_object(before, root_rank=0)
        state = opt.state_dict()["state"]
        for k, s in state.items():
            for name, v in s.items():
                want = root[k][name]
                same = torch.equal(v, want) if torch.is_tensor(v) else v == want
                c.true(f"{kind} state {k}.{name} is rank 0's", same)
        c.true(f"{kind} lr is rank 0's", opt.param_groups[0]["lr"] == (0.1 if kind == "sgd" else 0.01))
        sums[kind] = float(sum(v.double().sum() for s in state.values() for v in s.values() if torch.is_tensor(v)))
    fresh = torch.optim.Adam(_model(seed=r).parameters(), lr=0.01)  # no state yet: initialized, then broadcast
    hvd.broadcast_optimizer_state(fresh, root_rank=0)
    c.true("fresh Adam gets a state", len(fresh.state_dict()["state"]) == 4)
    return [list(c), sums]


def cuda_streams_and_copies(mb=64):
    """CUDA tensors: a tensor written on a side stream is read by the engine only once that
    stream's work is done (the current stream is named to it); with CUDA IPC nothing is copied
    to the host (``sdp.device_counters()``); results are CUDA tensors on the input's device."""
    c, r, n = _Checks(), hvd.rank(), hvd.size()
    c.device = "cuda"
    count = (mb << 20) // 4
    side = torch.cuda.Stream()
    before = sdp.device_counters()
    with torch.cuda.stream(side):
        x = torch.zeros(count, device="cuda")
        for _ in range(20):  # queue work on the side stream: the engine must wait for it
            x.add_(r + 1)
        got = hvd.allreduce(x, op=hvd.Sum)
    torch.cuda.synchronize()
    c.eq("allreduce after work on a side stream", got[:4], torch.full((4,), 20.0 * n * (n + 1) / 2, device="cuda"))
    c.true("the whole result", bool((got == 20.0 * n * (n + 1) / 2).all()))
    y = torch.full((1 << 20,), float(r), device="cuda", dtype=torch.bfloat16)
    c.true("allreduce_ of a CUDA bfloat16 tensor", hvd.allreduce_(y, op=hvd.Max) is y and bool((y == n - 1).all()))
    after = sdp.device_counters()
    if after.get("ipc"):
        c.true(f"no device-to-host copy with IPC: {before} -> {after}", after["d2h"] == before["d2h"])
    return list(c)


def sync_batch_norm():
    """SyncBatchNorm over ranks holding different batch sizes equals BatchNorm over the
    concatenated batch: output rows, running statistics, the input's gradient (weight's and
    bias's gradients are local: their sum over ranks is the whole batch's)."""
    c, r, n = _Checks(), hvd.rank(), hvd.size()
    g = torch.Generator().manual_seed(7)
    sizes = [q + 2 for q in range(n)]
    x = torch.randn(sum(sizes), 3, 5, generator=g, dtype=torch.float64)
    w = torch.randn(sum(sizes), 3, 5, generator=g, dtype=torch.float64)
    lo = sum(sizes[:r])
    mine = x[lo:lo + sizes[r]].clone().requires_grad_()
    sbn = hvd.SyncBatchNorm(3).double()
    out = sbn(mine)
    (out * w[lo:lo + sizes[r]]).sum().backward()
    ref = torch.nn.BatchNorm1d(3).double()
    whole = x.clone().requires_grad_()
    ref_out = ref(whole)
    (ref_out * w).sum().backward()
    c.eq("output", out, ref_out[lo:lo + sizes[r]])
    c.eq("running mean", sbn.running_mean, ref.running_mean)
    c.eq("running var", sbn.running_var, ref.running_var)
    c.eq("input gradient", mine.grad, whole.grad[lo:lo + sizes[r]])
    c.eq("weight gradient summed", hvd.allreduce(sbn.weight.grad, op=hvd.Sum), ref.weight.grad)
    c.eq("bias gradient summed", hvd.allreduce(sbn.bias.grad, op=hvd.Sum), ref.bias.grad)
    sbn.eval()
    c.eq("eval mode: running statistics", sbn(mine.detach()), ref.eval()(x)[lo:lo + sizes[r]])
    return list(c)


def optimizer_sparse():
    """Sparse gradients (nn.Embedding(sparse=True)) through DistributedOptimizer, as allgathers of
    indices and values and with sparse_as_dense=True, against one process on both ranks' data
    with dense gradients; returns [problems, max abs differences]."""
    c, r, n = _Checks(), hvd.rank(), hvd.size()
    ids = torch.tensor([[q % 7, (3 * q + 1) % 7, 5] for q in range(n)])
    diffs = []
    for dense in (False, True):
        def net(sparse):
            torch.manual_seed(3)
            return torch.nn.Sequential(torch.nn.Embedding(7, 4, sparse=sparse), torch.nn.Flatten(),
                                       torch.nn.Linear(12, 1)).double()
        model, ref = net(True), net(False)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                       named_parameters=model.named_parameters(), sparse_as_dense=dense)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
        for _ in range(2):
            opt.zero_grad()
            model(ids[r:r + 1]).pow(2).mean().backward()
            c.true(f"sparse gradient (sparse_as_dense={dense})", model[0].weight.grad.is_sparse)
            opt.step()
            ref_opt.zero_grad()
            ref(ids).pow(2).mean().backward()
            ref_opt.step()
        diffs.append(max(float((a - b).abs().max()) for a, b in zip(model.parameters(), ref.parameters())))
    return [list(c), diffs]


def _adasum(vectors):
    """Horovod's Adasum of a list of 1-D float64 arrays (a power of two of them), pairwise in
    rank order as the recursive halving combines them."""
    while len(vectors) > 1:
        nxt = []
        for a, b in zip(vectors[::2], vectors[1::2]):
            dot, na, nb = float(a @ b), float(a @ a), float(b @ b)
            nxt.append((1 - dot / (2 * na) if na else 1.0) * a + (1 - dot / (2 * nb) if nb else 1.0) * b)
        vectors = nxt
    return vectors[0]


def optimizer_adasum():
    """DistributedOptimizer(op=Adasum): each parameter moves by the Adasum of the ranks' local
    SGD steps (computed here from the allgathered deltas); returns [problems, max abs difference]."""
    c, r = _Checks(), hvd.rank()
    model, local = _model(seed=0), _model(seed=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), op=hvd.Adasum)
    local_opt = torch.optim.SGD(local.parameters(), lr=0.1)
    x, y = _batches(50 + r, 1, 1)
    start = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    c.true("every Adasum allreduce started during backward()", len(opt._handles) == 4)
    opt.step()
    local_opt.zero_grad()
    torch.nn.functional.mse_loss(local(x), y).backward()
    local_opt.step()
    diff = 0.0
    for p, s, q in zip(model.parameters(), start, local.parameters()):
        deltas = hvd.allgather((q.detach() - s).reshape(1, -1))
        want = s + torch.from_numpy(_adasum([d.numpy() for d in deltas])).reshape(s.shape)
        diff = max(diff, float((p.detach() - want).abs().max()))
    try:
        with opt.skip_synchronize():
            pass
        c.append("skip_synchronize: no AssertionError")
    except AssertionError:
        pass
    return [list(c), diff]
