"""Reads of a Keras model's layers that Keras keeps private: every sublayer, and the shapes a layer was built with.

Part of :mod:`hetero_cs.engine._compat`. This module imports nothing of hetero_cs, so calibration and the step's
own modules may read a model through it.
"""



def all_sublayers(model) -> list:
    """The model and every layer inside it, nested models and layers held as attributes included."""
    # Private: Keras 3's _flatten_layers (every supported Keras has it: symbols.REQUIRED) is the only walk that
    # reaches sublayers kept as plain attributes of a subclassed layer; `model.layers` lists only the top level. Used
    # to count a model's FLOPs for emulation.
    return list(model._flatten_layers(include_self=True, recursive=True))  # noqa: SLF001


def layer_build_shapes(layer) -> dict | None:
    """The input shapes a layer was built with ({argument name: shape}), or None."""
    # Private: a layer inside a subclassed model has no symbolic `output`; the shapes its build() received are the
    # only record of what it computes on (used to count its FLOPs for emulation).
    return getattr(layer, "_build_shapes_dict", None)


def batch_norms_in_training(model) -> list:
    """``model``'s trainable BatchNormalization layers: each all-reduces its batch statistics across replicas inside
    the forward pass (:mod:`hetero_cs.engine._compat.batch_norm`)."""
    import keras

    return [layer for layer in all_sublayers(model)
            if isinstance(layer, keras.layers.BatchNormalization) and getattr(layer, "trainable", False)]
