"""The model `hetero-cs calibrate --model` times: a reference model by name, or yours as ``package.module:function``.

``function()`` is called with no arguments inside the central-storage scope the calibration runs in (so build and
compile the model in it, and create no strategy of your own). It returns a compiled Keras model, or
``(model, sample_data)`` with ``sample_data`` = ``(x, y)`` or ``(x, y, sample_weight)``: arrays with a leading
batch dimension, e.g. a slice of your training data. Without sample data the batch is made up from the model's
input and output shapes: x at random in each input's dtype, and y as class labels in ``[0, C)`` for a sparse loss
(its name holds "sparse"), else zeros in the output's shape. Step time does not depend on the values, so that is
enough to time the step; give sample data when your loss needs something else.

Importing the module must not run TensorFlow ops (the devices are set up before, but TensorFlow cannot be told
about logical devices once it runs).
"""

import argparse
import importlib
import os
import re
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from calibration.models import MODEL_NAMES, build_model
from hetero_cs.errors import ConfigError

__all__ = ["build_calibration_model", "load_model_function", "model_spec"]

REFERENCE_INPUT_SHAPES = {"mlp": (64,), "digits_cnn": (8, 8, 1)}  # scikit-learn's 8x8 digits, flat or as an image
REFERENCE_NUM_CLASSES = 10
_SPEC = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")
_EXAMPLE = "--model mypackage.models:build_model"


def model_spec(text: str) -> str:
    """argparse type of --model: a reference name (mlp, digits_cnn) or ``package.module:function``."""
    if text in MODEL_NAMES or _SPEC.match(text):
        return text
    raise argparse.ArgumentTypeError(f"must be one of {', '.join(MODEL_NAMES)} or package.module:function (e.g. "
                                     f"{_EXAMPLE}), got {text!r}")


def load_model_function(spec: str) -> Callable[[], Any]:
    """Imports ``package.module:function`` (the function may be an attribute path, ``module:Class.method``).

    Raises:
        ConfigError: If the module cannot be imported, has no such attribute, or it is not callable.
    """
    module_name, _, attribute = spec.partition(":")
    # The console script (hetero-cs) does not put the working directory on the import path, as `python -m` does:
    # add it, so `hetero-cs calibrate --model mypackage.models:build` finds the package in the folder it runs from.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"--model={spec!r}: cannot import module {module_name!r} ({exc}). Run from the folder that "
                          f"holds the package, or install it, e.g. {_EXAMPLE}.") from exc
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise ConfigError(f"--model={spec!r}: module {module_name!r} has no attribute {attribute!r}.")
        target = getattr(target, part)
    if not callable(target):
        raise ConfigError(f"--model={spec!r} names a {type(target).__name__}, not a function that returns a model.")
    return target


def build_calibration_model(spec: str, *, global_batch_size: int, seed: int = 0) -> tuple[Any, tuple]:
    """Builds and compiles the model of ``spec`` and a sample batch of ``global_batch_size`` examples (if made up).

    Call it inside the strategy scope the calibration uses.

    Returns:
        (model, sample_batch): a built, compiled Keras model and (x, y) or (x, y, sample_weight).

    Raises:
        ConfigError: If the function's result is not a compiled, built Keras model, or not (model, sample_data) with
            sample_data (x, y[, sample_weight]), or no sample batch can be made up for it.
    """
    import keras

    if spec in MODEL_NAMES:  # its sample batch is made up below, as for a function that returns no sample data
        returned = build_model(spec, input_shape=REFERENCE_INPUT_SHAPES[spec], num_classes=REFERENCE_NUM_CLASSES)
        returned.compile(optimizer=keras.optimizers.Adam(1e-3),
                         loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    else:
        returned = load_model_function(spec)()
    model, sample = returned if isinstance(returned, tuple) and len(returned) == 2 else (returned, None)
    if not isinstance(model, keras.Model):
        raise ConfigError(f"--model={spec!r} returned {type(returned).__name__}; it must return a compiled "
                          "keras.Model, or (model, (x, y)) with sample data.")
    if not getattr(model, "compiled", False):
        raise ConfigError(f"--model={spec!r} returned an uncompiled model {model.name!r}: calibration times the "
                          "training step, so compile it with its optimizer and loss before returning it.")
    if not model.variables:
        raise ConfigError(f"--model={spec!r} returned a model that is not built ({model.name!r} has no variables): "
                          "start it with keras.Input(...) or call it once on a batch before returning it.")
    if sample is None:
        return model, _made_up_batch(spec, model, global_batch_size, np.random.default_rng(seed))
    if not isinstance(sample, (tuple, list)) or len(sample) not in (2, 3):
        raise ConfigError(f"--model={spec!r} returned sample data of type {type(sample).__name__}; give (x, y) or "
                          "(x, y, sample_weight), arrays with a leading batch dimension.")
    return model, tuple(sample)


def _made_up_batch(spec: str, model: Any, n: int, rng: np.random.Generator) -> tuple:
    try:
        inputs, outputs = list(model.inputs), list(model.outputs)
    except (AttributeError, ValueError) as exc:  # a subclassed model has no symbolic inputs
        raise ConfigError(f"--model={spec!r}: the model has no known input shape ({exc}); return (model, (x, y)) with "
                          "a sample of your data.") from exc
    shapes = [tuple(t.shape)[1:] for t in [*inputs, *outputs]]
    if len(outputs) != 1 or any(d is None for shape in shapes for d in shape):
        raise ConfigError(f"--model={spec!r}: cannot make up a sample batch for a model with {len(outputs)} outputs or "
                          f"unknown dimensions (input and output shapes {shapes}); return (model, (x, y)) with a "
                          "sample of your data.")
    xs = [_random(rng, (n, *tuple(t.shape)[1:]), t.dtype) for t in inputs]
    output_shape, classes = tuple(outputs[0].shape)[1:], tuple(outputs[0].shape)[-1]
    y = (rng.integers(0, max(int(classes or 1), 1), size=(n, *output_shape[:-1])).astype(np.int64)
         if "sparse" in _loss_name(getattr(model, "loss", None)).lower() else np.zeros((n, *output_shape), np.float32))
    return (xs[0] if len(xs) == 1 else xs), y


def _random(rng: np.random.Generator, shape: tuple, dtype: Any) -> np.ndarray:
    dtype = np.dtype(str(getattr(dtype, "name", dtype)))
    if dtype.kind in "iub":
        return np.zeros(shape, dtype)  # indices (e.g. for an Embedding): 0 is always valid
    return rng.standard_normal(shape).astype(dtype)


def _loss_name(loss: Any) -> str:
    return loss if isinstance(loss, str) else (
        getattr(loss, "name", None) or getattr(loss, "__name__", None) or type(loss).__name__)
