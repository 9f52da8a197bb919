"""``smdistributed.dataparallel.torch.torch_smddp``: importing it registers the
``torch.distributed`` backend name ``"smddp"`` (SMDDP v1.4 and later), which is sdp's backend
(``sdp.torch.distributed``): ``torch.distributed.init_process_group(backend="smddp")`` under
``sdprun``.  Like SageMaker's launcher, it also fills in ``LOCAL_RANK``, ``RANK`` and
``WORLD_SIZE`` (and ``SMDATAPARALLEL_LOCAL_RANK``) from sdp's environment where they are not set,
since SMDDP's scripts read them."""
import os

from sdp.torch import distributed as _backend

BACKEND = "smddp"


def _export_env() -> None:
    from sdp.common import topology
    topo = topology.from_env()
    if topo.source == "default":  # (no launcher)
        return
    for name, value in (("LOCAL_RANK", topo.local_rank), ("RANK", topo.rank), ("WORLD_SIZE", topo.size),
                        ("SMDATAPARALLEL_LOCAL_RANK", topo.local_rank)):
        os.environ.setdefault(name, str(value))


_backend.register(BACKEND)
_export_env()
