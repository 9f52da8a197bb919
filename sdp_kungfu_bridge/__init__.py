"""KungFu's Python/TensorFlow API on the sdp engine (filled in by the KungFu-bridge work)."""
