"""The collective engine: background runtime, negotiation, fusion and the collective algorithms.

Framework-free: works on numpy arrays (and device arrays through their interfaces) and never
imports TensorFlow or torch.
"""
import warnings as _warnings

# `python -m sdp.engine.native` (build the fast lane's step ahead of a job): `import sdp` imports
# that module before runpy runs it as __main__, which runpy warns about; here it is meant.
_warnings.filterwarnings("ignore", message=r"'sdp\.engine\.native' found in sys\.modules", category=RuntimeWarning)
