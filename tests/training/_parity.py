"""The sizes, data and twin models the model.fit parity tests share."""

from __future__ import annotations

import keras
from common import classifier, three_classes

N, B, M = 200, 50, 10


def data(n=N, seed=0):
    return three_classes(n, seed)


def mlp(optimizer=None):
    return classifier(6, 16, 3, optimizer or keras.optimizers.SGD(0.1, momentum=0.9))


def pair(make):
    reference, candidate = make(), make()
    for model in (reference, candidate):
        model.build((None, 6))
    candidate.set_weights(reference.get_weights())
    return reference, candidate
