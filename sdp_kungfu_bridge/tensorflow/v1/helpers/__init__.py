"""``kungfu.tensorflow.v1.helpers``: dataset readers (``mnist``, ``idx``, ``cifar``) and ``utils``."""
