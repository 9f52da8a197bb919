"""``smdistributed.dataparallel.torch.parallel.distributed``: the module SMDDP's scripts import
``DistributedDataParallel`` from; the same class as ``sdp.compat_smddp.torch.parallel``'s."""
from sdp.compat_smddp.torch.parallel import DistributedDataParallel  # noqa: F401
