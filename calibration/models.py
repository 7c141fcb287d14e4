"""Small reference models for the CLI, the examples and the benchmarks (Keras 3).

Build them inside a strategy's scope to get its variables; they are returned uncompiled and output logits.
"""

from collections.abc import Sequence
from typing import Any

from hetero_cs.errors import ConfigError

__all__ = ["MODEL_NAMES", "build_model"]

MODEL_NAMES = ("mlp", "digits_cnn")


def build_model(name: str, *, input_shape: Sequence[int], num_classes: int, dropout_rate: float = 0.25) -> Any:
    """Builds one of the reference classifiers (uncompiled, logits output).

    - "mlp": Flatten -> Dense(256, relu) -> Dense(256, relu) -> Dense(num_classes). For the 8x8 digits
      (input_shape=(64,)) that is 85,002 parameters.
    - "digits_cnn": Conv2D(32, 3x3, relu) -> Conv2D(64, 3x3, relu) -> MaxPooling2D(2) -> Flatten -> Dense(128, relu)
      -> Dropout(dropout_rate) -> Dense(num_classes), "same" padding; for 8x8x1 inputs (scikit-learn's digits)
      8x8 -> 8x8 -> 8x8 -> 4x4x64 = 1,024 features, 151,306 parameters: the model of examples/train_digits.py.

    Args:
        name: One of MODEL_NAMES.
        input_shape: Shape of one example, without the batch dimension; "digits_cnn" needs (H, W, C) with
            H, W >= 2.
        num_classes: Number of classes, >= 2.
        dropout_rate: Dropout rate of "digits_cnn", in [0, 1).

    Returns:
        A built keras.Model (named after `name`).

    Raises:
        ConfigError: For an unknown name or an invalid shape, class count or rate.

    Examples:
        >>> model = build_model("digits_cnn", input_shape=(8, 8, 1), num_classes=10)
        >>> model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    """
    import keras

    shape = tuple(int(d) for d in input_shape)
    if not shape or any(d < 1 for d in shape):
        raise ConfigError(f"input_shape must be a non-empty shape of positive sizes. Received: "
                          f"input_shape={input_shape!r}.")
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 2:
        raise ConfigError(f"num_classes must be an int >= 2. Received: num_classes={num_classes!r}.")
    if not 0.0 <= dropout_rate < 1.0:
        raise ConfigError(f"dropout_rate must be in [0, 1). Received: dropout_rate={dropout_rate!r}.")
    layers = keras.layers
    if name == "mlp":
        body = [layers.Flatten(), layers.Dense(256, activation="relu"), layers.Dense(256, activation="relu")]
    elif name == "digits_cnn":
        if len(shape) != 3 or shape[0] < 2 or shape[1] < 2:
            raise ConfigError(f"digits_cnn needs input_shape=(H, W, C) with H, W >= 2. Received: "
                              f"input_shape={shape!r}; for scikit-learn's digits use (8, 8, 1).")
        body = [layers.Conv2D(32, 3, padding="same", activation="relu"),
                layers.Conv2D(64, 3, padding="same", activation="relu"), layers.MaxPooling2D(2),
                layers.Flatten(), layers.Dense(128, activation="relu"), layers.Dropout(dropout_rate)]
    else:
        raise ConfigError(f"Unknown model name={name!r}. Use one of {list(MODEL_NAMES)}.")
    return keras.Sequential([keras.Input(shape), *body, layers.Dense(num_classes)], name=name)
