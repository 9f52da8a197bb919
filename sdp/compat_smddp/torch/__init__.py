"""``smdistributed.dataparallel.torch`` on sdp: SageMaker's data-parallel PyTorch API.

Under ``sdprun --compat smdistributed`` (or ``sdp.compat.install("smdistributed")``)
``smdistributed.dataparallel.torch`` is this package:

- ``.distributed`` (``import smdistributed.dataparallel.torch.distributed as dist``): SMDDP's
  functions before v1.4 (``init_process_group``, ``get_rank``, ``get_world_size``,
  ``get_local_rank``, ``all_reduce``, ``broadcast``, ``all_gather``, ``all_to_all_single``,
  ``barrier``, ``ReduceOp``, ``group``), on ``torch.distributed`` with sdp's backend;
- ``.parallel`` (and ``.parallel.distributed``): its ``DistributedDataParallel``, PyTorch's
  DDP on the ``sdp`` process group;
- ``.torch_smddp``: importing it registers the backend name ``"smddp"`` (SMDDP v1.4 and
  later: ``torch.distributed.init_process_group(backend="smddp")``), which is sdp's backend
  (``sdp.torch.distributed``).
"""
