"""``kungfu.datasets`` on sdp: KungFu's dataset adaptor (``.adaptor``), the sharding helper its
TF1 examples import beside ``kungfu.tensorflow.v1.helpers``."""
