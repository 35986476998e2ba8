"""Every Keras 3 and TensorFlow internal autosplit relies on, in one place.

autosplit must reproduce exactly what ``model.fit`` does on a full batch, and Keras
keeps some of that behind private attributes (the compiled loss's flat list of
per-output losses and their trackers, the compiled metrics, the loss tracker, the
symbolic build, the data adapters). Every such access lives here so that a Keras
upgrade touches one file; each function says what it reads. The patches of Keras's and
TensorFlow's behaviour sit behind one function each in the other modules of this package
(``batchnorm.recording``: BatchNormalization's ``_moments`` and moving-variable
``assign``; ``interception.intercept``, ``watch_targets``, ``watch_writes``: the
optimizer's apply, ``tf.GradientTape.gradient``, variables' ``assign*``), and what a
``tf.data`` graph holds is read in ``tf_data``. Elsewhere autosplit uses public names
only (``tests/test_package.py`` checks it). ``tests/keras_hooks/test_keras_canaries.py``
checks every one of these reliances directly and names the function to update when a
release changes it; :data:`CHECKED_ON` is the last versions they were checked on.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, NamedTuple

import keras
from keras.src.losses.loss import squeeze_or_expand_to_same_rank

__all__ = [
    "CHECKED_ON",
    "FlatLoss",
    "all_metrics",
    "call_has_training_arg",
    "compile_loss_built",
    "compile_state",
    "data_adapter",
    "flat_losses",
    "flatten_layers",
    "get_keras_mask",
    "global_seed_generator_kept",
    "gpu_pci_bus_id",
    "has_compiled_loss",
    "keras_loss_function",
    "loss_tracker",
    "metric_lists",
    "onednn_enabled",
    "output_loss_trackers",
    "outside_strategy_scope",
    "peeked_batches",
    "per_replica",
    "resolve_path",
    "resume_epoch",
    "seed_states",
    "set_keras_mask",
    "squeeze_or_expand_to_same_rank",
    "symbolic_build",
    "train_validation_split",
    "user_losses",
]


# Keras 3.0 to these: what tests/keras_hooks/test_keras_canaries.py passed on last.
CHECKED_ON = "Keras 3.15.1, TensorFlow 2.21.0"

class FlatLoss(NamedTuple):
    """One compiled loss: where its output sits and how it is weighted."""

    path: tuple  # keys/indices into y_true and y_pred; () for a single output
    loss: keras.losses.Loss
    weight: float | None  # `loss_weights` entry, None when not given


def get_keras_mask(x: Any) -> Any:
    """The Keras mask carried by a tensor (``_keras_mask``), or None."""
    return keras.backend.get_keras_mask(x) if hasattr(keras.backend, "get_keras_mask") else (
        getattr(x, "_keras_mask", None))


def set_keras_mask(x: Any, mask: Any) -> None:
    """Attach a Keras mask to a tensor (``keras.src.backend.set_keras_mask``)."""
    from keras.src.backend import set_keras_mask as setter

    setter(x, mask)


def symbolic_build(model: keras.Model, data_batch: tuple) -> None:
    """Build the model, its compiled loss and metrics and the optimizer, symbolically.

    ``data_batch`` is ``(x, y, sample_weight)`` of tensors, arrays or ``TensorSpec``s.
    ``model.fit`` does the same before it traces its train function
    (``Trainer._symbolic_build``); nothing is computed and no state changes. A built
    Functional or Sequential model skips the traced forward pass of Keras's build
    (:func:`_build_compiled_from_output_spec`).
    """
    if not _build_compiled_from_output_spec(model, data_batch):
        model._symbolic_build(data_batch=data_batch)
    if model.optimizer is not None and not model.optimizer.built:
        model.optimizer.build(model.trainable_variables)


def _build_compiled_from_output_spec(model: keras.Model, data_batch: tuple) -> bool:
    """``Trainer._symbolic_build`` for a built Functional or Sequential model, from its
    layers' shape inference rather than a traced forward pass (ten to twenty times
    cheaper); False, with nothing changed, where Keras's own build is needed."""
    from keras.src import backend
    from keras.src.models.functional import Functional
    from keras.src.trainers.data_adapters.data_adapter_utils import (
        unpack_x_y_sample_weight,
    )

    compile_metrics = getattr(model, "_compile_metrics", None)
    compile_loss = getattr(model, "_compile_loss", None)
    metrics_unbuilt = compile_metrics is not None and not compile_metrics.built
    loss_unbuilt = compile_loss is not None and not compile_loss.built
    own = next((cls for cls in (keras.Sequential, Functional) if isinstance(model, cls)), None)
    if (own is None or not (metrics_unbuilt or loss_unbuilt)
            or type(model).call is not own.call
            or type(model).compute_output_spec is not own.compute_output_spec
            or not all(layer.built for layer in model._flatten_layers())):
        return False
    x, y, sample_weight = unpack_x_y_sample_weight(keras.tree.map_structure(
        lambda v: None if v is None else backend.KerasTensor(
            v.shape, backend.standardize_dtype(v.dtype)), data_batch))
    try:
        y_pred = model.compute_output_spec(x, training=False)
    except Exception:  # inputs the layers' shape inference does not take: Keras's way
        return False
    if isinstance(y_pred, (list, tuple)) and len(y_pred) == 1:
        y_pred = y_pred[0]  # as Functional.call unpacks a single output
    if metrics_unbuilt:
        backend.compute_output_spec(model.compute_metrics, x, y, y_pred,
                                    sample_weight=sample_weight)
    if loss_unbuilt:
        backend.compute_output_spec(model._compute_loss, x, y, y_pred,
                                    sample_weight=sample_weight, training=False)
    return True


def user_losses(model: keras.Model) -> Any:
    """The ``loss`` given to ``model.compile``, as given (``CompileLoss._user_loss``)."""
    compile_loss = getattr(model, "_compile_loss", None)
    return getattr(compile_loss, "_user_loss", None)


def has_compiled_loss(model: keras.Model) -> bool:
    """Whether ``model.compile`` was given a ``loss`` (``Trainer._compile_loss``)."""
    return getattr(model, "_compile_loss", None) is not None


def compile_loss_built(model: keras.Model) -> bool:
    compile_loss = getattr(model, "_compile_loss", None)
    return compile_loss is None or compile_loss.built


def call_has_training_arg(model: keras.Model) -> bool:
    """Whether ``model.call`` takes ``training`` (``Layer._call_has_training_arg``)."""
    return getattr(model, "_call_has_training_arg", True)


def flatten_layers(model: keras.Model) -> list:
    """Every layer of the model, nested ones included (``Layer._flatten_layers``)."""
    return list(model._flatten_layers())


def seed_states(model: keras.Model) -> list:
    """The state variables of every ``SeedGenerator`` the model's layers draw from
    (``Layer._seed_generators``; Dropout's, a noise layer's, a random augmentation's), and
    of Keras's global one where it exists (a draw with ``seed=None``). Each draw is a
    stateless op on its generator's state, so a forward pass run again from the same
    states draws the same values."""
    from keras.src.backend.common import global_state

    found, seen = [], set()
    for layer in flatten_layers(model):
        for generator in getattr(layer, "_seed_generators", ()):
            if id(generator) not in seen:
                seen.add(id(generator))
                found.append(generator.state)
    shared = global_state.get_global_attribute("global_seed_generator")
    if shared is not None:
        found.append(shared.state)
    return found


def flat_losses(model: keras.Model) -> list[FlatLoss]:
    """The compiled loss as a flat list, in Keras's own order (``CompileLoss._flat_losses``)."""
    compile_loss = getattr(model, "_compile_loss", None)
    if compile_loss is None or not getattr(compile_loss, "built", True):
        # Not built: Keras builds it on the first compute_loss, which a model with its
        # own train_step may call in its step's trace, or never (a step calling
        # `self.loss(y, y_pred)` itself); the plain step builds it first (build_for).
        return []
    flat = getattr(compile_loss, "_flat_losses", None)
    if flat is None:
        raise RuntimeError(
            "autosplit could not read the compiled loss of this Keras version "
            f"({keras.__version__}): `model._compile_loss` has no `_flat_losses`."
        )
    return [FlatLoss(tuple(entry[0]), entry[1], entry[2]) for entry in flat]


def keras_loss_function(loss: Any) -> tuple[Any, dict] | None:
    """``(fn, fn_kwargs)`` of a loss that is Keras's own wrapper of a function (``"mse"``,
    ``keras.losses.MeanSquaredError()``), or None (a class of the user's, which may
    compute anything)."""
    from keras.src.losses.losses import LossFunctionWrapper

    if not (isinstance(loss, LossFunctionWrapper) and type(loss).__module__.startswith("keras.")):
        return None
    return loss.fn, dict(loss._fn_kwargs)


def output_loss_trackers(model: keras.Model) -> list:
    """The ``Mean`` metrics behind ``<output>_loss`` in the logs, one per compiled loss.

    Keras creates them only when there is more than one loss (``CompileLoss.build``)
    and updates each with the *unweighted* loss of its output; empty otherwise.
    """
    compile_loss = getattr(model, "_compile_loss", None)
    trackers = list(getattr(compile_loss, "metrics", []) or []) if compile_loss else []
    return trackers if len(trackers) == len(flat_losses(model)) else []


def metric_lists(model: keras.Model) -> tuple[list, list, Any]:
    """(unweighted, weighted, flatten_fn) of the compiled metrics, one entry per output.

    ``metrics=`` entries get no sample weight from Keras; ``weighted_metrics=`` do.
    """
    compile_metrics = getattr(model, "_compile_metrics", None)
    if compile_metrics is None or not compile_metrics.built:
        return [], [], keras.tree.flatten
    return (
        list(compile_metrics._flat_metrics),
        list(compile_metrics._flat_weighted_metrics),
        compile_metrics._flatten_y,
    )


def all_metrics(model: keras.Model) -> list:
    """``model.metrics`` and Keras's own trackers, once each. A model that overrides the
    ``metrics`` property (keras-io's masked language model lists only its own tracker)
    hides Keras's ``loss`` tracker and compiled metrics, which Keras's default
    ``train_step`` updates all the same (``Trainer._get_own_metrics``)."""
    own = getattr(model, "_get_own_metrics", None)
    metrics = list(model.metrics) + (list(own()) if callable(own) else [])
    return list({id(m): m for m in metrics}.values())


def loss_tracker(model: keras.Model) -> keras.metrics.Metric | None:
    """The ``Mean`` metric behind the ``loss`` entry of the logs."""
    return getattr(model, "_loss_tracker", None)


def compile_state(model: keras.Model) -> tuple[Any, Any, Any]:
    """What ``model.compile`` made, by identity: (the loss tracker, the compiled loss,
    the compiled metrics) (``Trainer._loss_tracker``, ``_compile_loss``,
    ``_compile_metrics``); a new ``compile()`` makes new ones."""
    return (getattr(model, "_loss_tracker", None), getattr(model, "_compile_loss", None),
            getattr(model, "_compile_metrics", None))


def onednn_enabled() -> bool:
    """Whether TensorFlow runs its oneDNN kernels (``TF_ENABLE_ONEDNN_OPTS``): TensorFlow's
    ``_pywrap_util_port.IsMklEnabled``, which has no public accessor."""
    from tensorflow.python.util import _pywrap_util_port

    return bool(_pywrap_util_port.IsMklEnabled())


def resume_epoch(model: keras.Model) -> int | None:
    """The epoch ``keras.callbacks.BackupAndRestore`` restored (``Trainer._initial_epoch``)."""
    return getattr(model, "_initial_epoch", None)


def resolve_path(path: tuple, obj: Any) -> Any:
    """``obj[path[0]][path[1]]...``, as ``CompileLoss`` resolves an output."""
    for key in path:
        obj = obj[key]
    return obj


def data_adapter(data: Any, *, shuffle: bool | str, class_weight: dict | None) -> Any:
    """Keras's own adapter for a ``PyDataset`` or a generator (``get_data_adapter``).

    It runs PyDataset workers and multiprocessing, applies ``class_weight`` and peeks
    a generator's first batches for their spec exactly as ``model.fit`` does.
    """
    from keras.src.trainers.data_adapters import get_data_adapter

    return get_data_adapter(data, shuffle=shuffle, class_weight=class_weight)


def peeked_batches(adapter: Any) -> list:
    """The first batches Keras's generator adapter read for the spec (and put back)."""
    return list(adapter._first_batches)


def train_validation_split(arrays: tuple, validation_split: float) -> tuple:
    """``model.fit``'s split of arrays: the last ``validation_split`` of rows, unshuffled."""
    from keras.src.trainers.data_adapters.array_slicing import train_validation_split as split

    return split(arrays, validation_split=validation_split)


def gpu_pci_bus_id(index: int) -> str | None:
    """TensorFlow's PCI bus id for GPU:<index> (``device_lib``), or None.

    ``get_device_details()`` has only name and compute capability; the bus id is in the
    device description. Listing logical devices first initialises the runtime with the
    user's GPU options, so ``device_lib`` reuses its allocators.
    """
    import re

    import tensorflow as tf
    from tensorflow.python.client import device_lib

    tf.config.list_logical_devices("GPU")
    for device in device_lib.list_local_devices():
        if device.device_type == "GPU" and device.name.endswith(f"GPU:{index}"):
            match = re.search(r"pci bus id: ([0-9a-fA-F:.]+)", device.physical_device_desc)
            return match.group(1) if match else None
    return None


def per_replica(values: list) -> Any:
    """A ``PerReplica`` value from one tensor per local replica (tf.distribute internal)."""
    from tensorflow.python.distribute import values as distribute_values

    return distribute_values.PerReplica(tuple(values))


# Where tf.distribute's scopes define the variable creators they install.
_DISTRIBUTE_LIB = "tensorflow.python.distribute.distribute_lib"


@contextlib.contextmanager
def outside_strategy_scope() -> Iterator[None]:
    """Run the block as if outside the caller's ``with strategy.scope():`` (tf.distribute
    internals: the default graph's thread-local strategy and variable-creator stacks).

    Inside a scope the thread is in the strategy's cross-replica context: a distributed
    variable has no ``handle`` there (a tape over the model's weights fails), and every
    ``tf.Variable`` becomes a distributed one. ``model.fit`` meets neither, as all its
    graph code runs in ``strategy.run``; autosplit also traces and computes outside it
    (the loss plan, one replica's step, the host-side stash), which outside the scope
    is the default replica context. So the scope's mode and its variable creator are set
    aside for the block and put back, the same lists, after it: the caller's scope then
    exits as it would have. autosplit enters the model's strategy itself where it needs
    it (``strategy.scope()`` around the sums and the build). Outside every scope, and in
    a replica context, nothing changes.
    """
    import tensorflow as tf
    from tensorflow.python.framework import ops

    if not tf.distribute.in_cross_replica_context():
        yield
        return
    graph = ops.get_default_graph()
    modes, creators = graph._distribution_strategy_stack, graph._variable_creator_stack
    graph._distribution_strategy_stack = []
    graph._variable_creator_stack = [
        (priority, creator) for priority, creator in creators
        if getattr(creator, "__module__", None) != _DISTRIBUTE_LIB]  # the user's own stay
    try:
        yield
    finally:
        graph._distribution_strategy_stack = modes
        graph._variable_creator_stack = creators


@contextlib.contextmanager
def global_seed_generator_kept() -> Iterator[None]:
    """Keras's global ``SeedGenerator`` (what ``keras.random.normal`` without a seed
    draws from) as it was before, around a trace that is never run.

    Keras makes it on first use. Made while a function is only traced, its state
    variable is never initialized, and the model's next real step (``model.fit``'s too)
    fails with "seed must have shape [2], not [0]". Reads
    ``keras.src.backend.common.global_state``'s ``"global_seed_generator"``.
    """
    from keras.src.backend.common import global_state

    name = "global_seed_generator"
    before = global_state.get_global_attribute(name)
    try:
        yield
    finally:
        if before is None:
            global_state.set_global_attribute(name, None)

