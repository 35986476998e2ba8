"""structured_data/structured_data_classification_from_scratch.py, shrunk: the heart
disease table (categorical strings and integers, numerical columns) through StringLookup,
IntegerLookup and Normalization adapted on the data, one named input per column (a dict),
trained with model.fit and with fit_large_batch.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf
from _compare import ADAM_RTOL, assert_exact
from keras import layers


def heart_table(n, seed=0):
    rng = np.random.default_rng(seed)
    table = {
        "sex": rng.integers(0, 2, size=n), "cp": rng.integers(0, 5, size=n),
        "fbs": rng.integers(0, 2, size=n), "restecg": rng.integers(0, 3, size=n),
        "exang": rng.integers(0, 2, size=n), "ca": rng.integers(0, 4, size=n),
        "thal": rng.choice(["fixed", "normal", "reversible", "1", "2"], size=n),
        "age": rng.integers(29, 78, size=n), "trestbps": rng.integers(94, 201, size=n),
        "chol": rng.integers(126, 565, size=n), "thalach": rng.integers(71, 203, size=n),
        "oldpeak": rng.uniform(0, 6.2, size=n), "slope": rng.integers(1, 4, size=n),
    }
    target = ((table["cp"] > 2) | (table["thal"] == "reversible")).astype("int32")
    return table, target


INTEGER_FEATURES = ["sex", "cp", "fbs", "restecg", "exang", "ca"]
STRING_FEATURES = ["thal"]
NUMERICAL_FEATURES = ["age", "trestbps", "chol", "thalach", "oldpeak", "slope"]


def encode_numerical_feature(feature, name, dataset):
    normalizer = layers.Normalization()
    feature_ds = dataset.map(lambda x, y: x[name]).map(lambda x: tf.expand_dims(x, -1))
    normalizer.adapt(feature_ds)
    return normalizer(feature)


def encode_categorical_feature(feature, name, dataset, is_string):
    lookup_class = layers.StringLookup if is_string else layers.IntegerLookup
    lookup = lookup_class(output_mode="binary")  # one-hot style, as in the example
    feature_ds = dataset.map(lambda x, y: x[name]).map(lambda x: tf.expand_dims(x, -1))
    lookup.adapt(feature_ds)
    return lookup(feature)


def test_structured_data_with_lookup_and_normalization_layers():
    n, batch, micro = 120, 60, 25
    table, target = heart_table(n)
    columns = {name: np.asarray(v, "int64" if name in INTEGER_FEATURES else
                                "float32" if name in NUMERICAL_FEATURES else None)
               for name, v in table.items()}
    # The example's dataframe_to_dataset, batched by 32, for the layers' adapt().
    train_ds = tf.data.Dataset.from_tensor_slices((columns, target)).batch(32)
    x = {name: v[:, None] for name, v in columns.items()}
    x["thal"] = tf.constant(columns["thal"])[:, None]  # Keras takes no NumPy unicode array

    def make():
        inputs = {name: keras.Input(shape=(1,), name=name, dtype="int64")
                  for name in INTEGER_FEATURES}
        inputs["thal"] = keras.Input(shape=(1,), name="thal", dtype="string")
        inputs |= {name: keras.Input(shape=(1,), name=name) for name in NUMERICAL_FEATURES}
        encoded = [encode_categorical_feature(inputs[name], name, train_ds, False)
                   for name in INTEGER_FEATURES]
        encoded.append(encode_categorical_feature(inputs["thal"], "thal", train_ds, True))
        encoded += [encode_numerical_feature(inputs[name], name, train_ds)
                    for name in NUMERICAL_FEATURES]
        all_features = layers.concatenate(encoded)
        h = layers.Dense(32, activation="relu")(all_features)
        h = layers.Dropout(0.0)(h)  # 0.5 in the example
        output = layers.Dense(1, activation="sigmoid")(h)
        model = keras.Model(inputs, output)
        model.compile("adam", "binary_crossentropy", metrics=["accuracy"])
        return model

    assert_exact(make, x, target, n=n, batch_size=batch, micro_batch_size=micro,
                 rtol=ADAM_RTOL)
