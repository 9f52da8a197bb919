"""``smdistributed.dataparallel.torch.parallel`` on sdp: SMDDP's ``DistributedDataParallel``."""
import torch.distributed as _dist
from torch.nn.parallel import DistributedDataParallel as _TorchDDP


class DistributedDataParallel(_TorchDDP):
    """SMDDP's ``DistributedDataParallel``: PyTorch's DDP over the default process group, which
    ``smdistributed.dataparallel.torch.distributed.init_process_group`` put on sdp's backend
    (gradients averaged over ranks in buckets of ``bucket_cap_mb`` MB, default 25, started as
    they are ready in ``backward()``; ``no_sync()`` accumulates locally).  ``process_group``
    must be None or ``group.WORLD`` (SMDDP supports no other), else ``ValueError``.  Raises
    ``ValueError`` (PyTorch's) before ``init_process_group``.  Mirrors
    ``smdistributed.dataparallel.torch.parallel.DistributedDataParallel(module, device_ids=None,
    output_device=None, broadcast_buffers=True, process_group=None, bucket_cap_mb=None)``."""

    def __init__(self, module, device_ids=None, output_device=None, broadcast_buffers=True, process_group=None,
                 bucket_cap_mb=None, **kwargs):
        if process_group is not None and process_group is not _dist.group.WORLD:
            raise ValueError("DistributedDataParallel: process groups are not supported in "
                             "smdistributed.dataparallel; the only group is group.WORLD")
        if not broadcast_buffers:  # (PyTorch deprecates the argument; True is its default)
            kwargs["broadcast_buffers"] = False
        super().__init__(module, device_ids=device_ids, output_device=output_device, process_group=None,
                         bucket_cap_mb=25 if bucket_cap_mb is None else bucket_cap_mb, **kwargs)
