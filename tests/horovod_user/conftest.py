"""The files here are *Horovod users'* test files, kept unmodified: they import ``horovod.*`` and
need several ranks, so they only make sense under ``sdprun --compat horovod -np N python -m pytest
<file>`` (tests/test_horovod_fidelity.py runs them that way).  In a plain ``pytest`` run (CI's
suite) they are not collected."""
import os

if "horovod" not in os.environ.get("SDP_COMPAT", "").split(","):
    collect_ignore_glob = ["test_*.py"]
