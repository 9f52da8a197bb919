"""The collective engine: background runtime, negotiation, fusion and the collective algorithms.

Framework-free: works on numpy arrays (and device arrays through their interfaces) and never
imports TensorFlow or torch.
"""
