"""The collective engine: background runtime, negotiation, fusion and the collective algorithms.

Framework-free: works on numpy arrays and never imports TensorFlow.
"""
