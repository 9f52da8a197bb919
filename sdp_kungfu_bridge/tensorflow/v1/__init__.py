"""``kungfu.tensorflow.v1`` on sdp: KungFu's TF1-era helpers that its examples import.

- ``.helpers``: ``mnist`` (``load_datasets``), ``idx`` (the IDX file format), ``cifar``
  (CIFAR-10/100 pickles), ``utils`` (``show_size``, ``show_rate``).
- ``.benchmarks``: ``model_sizes`` (parameter tensor sizes of ResNet-50 and VGG-16) and the
  fake-data allreduce benchmark (``python -m kungfu.tensorflow.v1.benchmarks``) on sdp's engine.
- ``.ops``: ``kungfu.tensorflow.ops``' names (``sdp_kungfu_bridge.tensorflow.ops``).
"""
