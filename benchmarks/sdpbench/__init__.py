"""The sections of ``benchmarks/allreduce.py`` (the entry point, with its command line, its
targets and ``main``), one module each, so that the script reads as the steps of a run and the
other benchmarks share its helpers:

* ``common``: sizes and their names, busbw, the max over ranks, iteration planning, the timing
  loop every table uses, the environment line;
* ``measure``: sdp's own measurements (the size table's allreduce, the gradient list fused and
  unfused, the memory floor of a shared-memory allreduce);
* ``baselines``: TensorFlow's collective ring in the same run, Horovod's status;
* ``hosts``: across hosts, flat ring against hierarchical and the link itself;
* ``apis``: ``--api``, the same allreduce through the engine and the TensorFlow face.

The latency section is ``benchmarks/latency.py`` (older, and run on its own by other scripts).
A package beside the scripts, not under ``sdp/``: nothing here is part of the library.
"""
