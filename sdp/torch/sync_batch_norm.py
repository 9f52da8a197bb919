"""Horovod's ``SyncBatchNorm`` on sdp (``horovod.torch.sync_batch_norm`` under ``sdprun --compat
horovod``): batch normalization whose statistics are those of the global batch.

In training, each rank's per-channel count, mean and biased variance of its input ``(N, C, ...)``
are allgathered (one collective) and combined into the global batch's mean and variance, which
normalize the input and update ``running_mean``/``running_var`` (unbiased variance, ``momentum``;
``momentum=None`` is the cumulative average); backward allreduces the per-channel sums of the
gradient and of gradient x centred input (Sum), so the input's gradient is the global batch's.
The weight's and bias's gradients stay local (``DistributedOptimizer`` averages them).  In eval
mode with running statistics it is plain batch norm.  Unlike Horovod's (GPU only), CPU and CUDA
inputs both work (the statistics are computed with torch operations).  Ranks may hold different
batch sizes (a rank with an empty batch still takes part).
"""
import torch
from torch.nn.modules.batchnorm import _BatchNorm

from sdp import api
from sdp.torch import tensors as _t
from sdp.torch.mpi_ops import size


def _per_channel(x: torch.Tensor) -> torch.Tensor:
    """``x`` (N, C, ...) as (C, N * ...)."""
    return x.transpose(0, 1).reshape(x.shape[1], -1)


class _SyncBatchNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, weight, bias, running_mean, running_var, eps, momentum):
        acc = torch.float64 if input.dtype == torch.float64 else torch.float32
        x = _per_channel(input).to(acc)
        n = x.shape[1]
        mean = x.mean(1) if n else torch.zeros(x.shape[0], dtype=acc, device=x.device)
        var = x.var(1, unbiased=False) if n else torch.zeros_like(mean)
        stats = torch.cat([torch.tensor([float(n)], dtype=acc, device=x.device), mean, var]).unsqueeze(0)
        gathered = _t.as_tensor(api.allgather(_t.as_input(stats), name="sync_batch_norm.stats"), stats.device)
        counts, means, variances = gathered[:, :1], gathered[:, 1:1 + mean.numel()], gathered[:, 1 + mean.numel():]
        total = counts.sum()
        g_mean = (counts * means).sum(0) / total
        g_var = (counts * (variances + (means - g_mean) ** 2)).sum(0) / total
        if running_mean is not None:
            with torch.no_grad():
                running_mean.mul_(1 - momentum).add_(momentum * g_mean.to(running_mean.dtype))
                unbiased = g_var * (total / (total - 1)) if total > 1 else g_var
                running_var.mul_(1 - momentum).add_(momentum * unbiased.to(running_var.dtype))
        invstd = torch.rsqrt(g_var + eps)
        shape = [1, -1] + [1] * (input.dim() - 2)
        xhat = (input.to(acc) - g_mean.view(shape)) * invstd.view(shape)
        ctx.save_for_backward(input, weight, g_mean, invstd)
        ctx.total = total
        out = xhat * weight.view(shape) + bias.view(shape) if weight is not None else xhat
        return out.to(input.dtype)

    @staticmethod
    def backward(ctx, grad_output):
        input, weight, mean, invstd = ctx.saved_tensors
        acc = mean.dtype
        shape = [1, -1] + [1] * (input.dim() - 2)
        g = _per_channel(grad_output.contiguous()).to(acc)
        xmu = _per_channel(input).to(acc) - mean.unsqueeze(1)
        sum_dy, sum_dy_xmu = g.sum(1), (g * xmu).sum(1)
        grad_weight = grad_bias = None
        if weight is not None and ctx.needs_input_grad[1]:
            grad_weight = (sum_dy_xmu * invstd).to(weight.dtype)
        if weight is not None and ctx.needs_input_grad[2]:
            grad_bias = sum_dy.to(weight.dtype)
        grad_input = None
        if ctx.needs_input_grad[0]:
            sums = torch.cat([sum_dy, sum_dy_xmu])
            sums = _t.as_tensor(api.allreduce(_t.as_input(sums), name="sync_batch_norm.sums", op=api.ReduceOp.SUM),
                                sums.device)
            c = mean.numel()
            mean_dy, mean_dy_xmu = sums[:c] / ctx.total, sums[c:] / ctx.total
            scale = invstd * (weight.to(acc) if weight is not None else 1.0)
            grad_input = (grad_output.to(acc) - mean_dy.view(shape)
                          - (input.to(acc) - mean.view(shape)) * (invstd ** 2 * mean_dy_xmu).view(shape))
            grad_input = (grad_input * scale.view(shape)).to(input.dtype)
        return grad_input, grad_weight, grad_bias, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """Batch normalization over the global batch of every rank (see the module docstring);
    input ``(N, C, ...)`` with at least 2 dimensions (``ValueError`` otherwise).  Mirrors
    ``horovod.torch.SyncBatchNorm`` (its arguments and defaults)."""

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True, track_running_stats=True):
        super().__init__(num_features, eps, momentum, affine, track_running_stats)

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input):
        self._check_input_dim(input)
        if size() == 1 or not self.training and self.track_running_stats:
            return super().forward(input)  # (plain batch norm)
        if self.track_running_stats:
            self.num_batches_tracked = self.num_batches_tracked + 1
        momentum = self.momentum
        if momentum is None:  # cumulative moving average
            momentum = 1.0 / float(self.num_batches_tracked) if self.track_running_stats else 0.0
        return _SyncBatchNorm.apply(input, self.weight, self.bias, self.running_mean, self.running_var,
                                    self.eps, momentum)
