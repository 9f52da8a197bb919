"""``kungfu.tensorflow.v1.benchmarks.model_sizes``: the element counts of a model's trainable
tensors, the gradient list one training step allreduces.  ``resnet50_imagenet`` and
``vgg16_imagenet`` (lists of ints) are measured from ``tf.keras.applications`` (ImageNet shapes,
1000 classes, no weights downloaded) when first read (~seconds); ``sizes_of(model)`` measures any
Keras model.  KungFu's ``bert`` list has no Keras application to measure: reading it raises
``AttributeError``."""
_BUILDERS = {"resnet50_imagenet": "ResNet50", "vgg16_imagenet": "VGG16"}
_cache = {}


def sizes_of(model):
    """Element counts of ``model.trainable_weights``, in order."""
    return [int(w.shape.num_elements()) for w in model.trainable_weights]


def __getattr__(name):
    if name not in _BUILDERS:
        raise AttributeError(f"module 'kungfu.tensorflow.v1.benchmarks.model_sizes' (sdp) has no attribute {name!r}")
    if name not in _cache:
        import tensorflow as tf
        model = getattr(tf.keras.applications, _BUILDERS[name])(weights=None, classes=1000)
        _cache[name] = sizes_of(model)
        del model
    return _cache[name]
