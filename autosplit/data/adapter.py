"""Input adapters: every kind of input ``model.fit`` takes, as one small interface
(:class:`InputAdapter`), one module per kind, and ``autosplit.data.inputs.get_input``
to pick one.

Separation of concerns (after Keras's ``trainers/data_adapters/``): an adapter knows
one input kind and turns it into a host-side ``tf.data`` stream of *rows*, batched any
way the input likes; ``autosplit.data.pipeline`` cuts that stream into micro-batches; the
compiled step (``autosplit.step.train_step``) pulls them. No adapter ever builds a large batch.

========================  ============================================================
input                     rows stream
========================  ============================================================
arrays ``(x, y[, w])``    batches of row *numbers* (shuffled each epoch); the pipeline
                          gathers each micro-batch's rows from the arrays on the host
``tf.data`` of examples   the examples, batched by 256 on the host
``tf.data``, batched      the user's batches as they come, any size (rebatched later)
``keras.utils.PyDataset`` Keras's own PyDataset adapter (workers, multiprocessing)
Python generator          Keras's own generator adapter; read once, not rewound
========================  ============================================================

Every element is ``(x, y)`` or ``(x, y, sample_weight)``; each part may be a tensor,
tuple or dict. ``class_weight`` becomes a sample weight, as in ``model.fit``. All
checks run before any state changes and raise ``DatasetError``.
"""


from __future__ import annotations

import dataclasses
from typing import Any, Literal

import tensorflow as tf

from autosplit.data.sequences.lengths import Lengths, PaddedArrays, lengths_of, tie
from autosplit.data.structure import leaves_named
from autosplit.errors import DatasetError, describe

__all__ = [
    "EXAMPLE_CHUNK",
    "HINT",
    "InputAdapter",
    "InputFacts",
    "arity",
    "check_class_weight_alone",
    "check_known_rank",
    "check_shared_rows",
    "class_weight_fn",
    "leading_rows",
    "varying_axes",
    "varying_shapes",
]

HINT = ("Pass arrays (x, y[, sample_weight]), a tf.data.Dataset of (x, y[, sample_weight]) "
        "(single examples or batches), a keras.utils.PyDataset or a Python generator.")
EXAMPLE_CHUNK = 256  # examples per host batch before the cut; any size gives the same rows


def _present(parts: tuple) -> list[tuple[str, Any]]:
    """The leaves of ``(x, y[, sample_weight])`` but None, named as messages name them."""
    return [(name, leaf) for name, leaf in leaves_named(tuple(parts)) if leaf is not None]


def leading_rows(parts: tuple) -> dict[str, int | None]:
    """``{"x[0]": rows, "y": rows, ...}``: the leading dimension of every leaf."""
    counts: dict[str, int | None] = {}
    for label, leaf in _present(parts):
        shape = tf.TensorShape(getattr(leaf, "shape", None))
        counts[label] = None if shape.rank in (None, 0) else shape[0]
    return counts


def check_shared_rows(parts: tuple, what: str) -> None:
    """Refuse a batch (or spec) whose leaves do not share one number of rows."""
    counts = leading_rows(parts)
    if len({n for n in counts.values() if n is not None}) > 1:
        raise DatasetError(
            f"Expected every part of a batch of {what} to have the same number of rows "
            f"(one row per example). Received: rows {counts}. Inputs whose parts do not "
            "share a row count (a merged graph of atoms and bonds, say) cannot be split "
            "into micro-batches by rows: train them with model.fit.")


def check_known_rank(parts: tuple, what: str) -> None:
    """Refuse, before anything runs, parts whose rank is unknown: the pipeline cuts and
    pads every part along its axes."""
    unknown = [f"{label}: {leaf}" for label, leaf in _present(parts)
               if isinstance(leaf, tf.TensorSpec) and leaf.shape.rank is None]
    if unknown:
        raise DatasetError(
            f"Expected every part of {what} to have a known rank (its number of axes). "
            f"Received: {', '.join(unknown)}. Give the parts their shapes, e.g. "
            "output_signature=tf.TensorSpec([None], tf.int32) in from_generator, or "
            "dataset.map(lambda x, y: (tf.ensure_shape(x, [None, 3]), y)).")


def varying_shapes(element_spec: Any) -> bool:
    """Whether batches of ``element_spec`` may differ beyond their row count (a
    ``padded_batch`` of sequences of varying length: a dimension after the rows of
    unknown size)."""
    return any(isinstance(leaf, tf.TensorSpec) and leaf.shape.rank is not None
               and None in leaf.shape.as_list()[1:] for leaf in tf.nest.flatten(element_spec))


@dataclasses.dataclass(frozen=True)
class InputFacts:
    """What an input is, read once when its adapter is made (``InputAdapter.facts``):
    the cut, the probe and the pipeline read it, nothing infers it again.

    >>> facts = InputFacts("arrays", rows=100, row_numbers=True)
    >>> facts.rows_vary, facts.reiterable
    (False, True)
    """

    kind: str  # what the user passed, for messages and FitReport.input
    batched: bool = False  # its elements are its own batches (of any size), not examples
    rows: int | None = None  # examples in one epoch; None: only the end of the data tells
    infinite: bool = False  # it never ends (a repeat()): steps_per_epoch must say
    reiterable: bool = True  # a second pass reads the data again (a generator's: no)
    # the stream's rows are row numbers (arrays), which materialize turns into data:
    # padding them copies no data
    row_numbers: bool = False
    shares: bool = False  # its elements are this worker's shares of each step (sharded)
    arity: int = 2  # elements (x, y) 2, (x, y, w) 3, x alone (no targets) 0
    # per part whose rows vary in shape: its name and the axis (1: the first after the
    # rows) along which it does
    varying: tuple[tuple[str, int], ...] = ()
    # where a varying row's length comes from: "example", each as long as it is;
    # "batch", as long as the input's own batch padded it (a padded_batch, a generator's
    # batches, a map to a fixed length TensorFlow's shapes do not know); "share", as
    # TensorFlow's rebatch of each worker's padded_batch(B) padded it; None: one shape
    lengths_from: Literal["example", "batch", "share"] | None = None
    # tf.data's default static rewrites run on the pipeline (map-and-batch fusion, map
    # parallelization, on the input's own stages too): arrays turn them off (ArrayInput)
    graph_rewrites: bool = True

    @property
    def rows_vary(self) -> bool:
        """Whether its rows vary in shape beyond their count (sequences of varying length)."""
        return bool(self.varying)


def varying_axes(spec: Any, batched: bool) -> tuple[tuple[str, int], ...]:
    """The parts of ``spec`` (an element's, ``(x, y[, w])`` or x alone) whose rows vary in
    shape, and along which axis (1: the first after the rows): an axis of unknown size
    after the rows of a batch, or of an example.

    >>> varying_axes((tf.TensorSpec([None, None]), tf.TensorSpec([None])), batched=True)
    (('x', 1),)
    """
    found = []
    for name, leaf in _present(spec if isinstance(spec, tuple) else (spec,)):
        if not isinstance(leaf, tf.TensorSpec) or leaf.shape.rank is None:
            continue
        axes = leaf.shape.as_list()[1:] if batched else leaf.shape.as_list()
        found += [(name, axis + 1) for axis, size in enumerate(axes) if size is None]
    return tuple(found)


class InputAdapter:
    """One input kind as a host-side stream of rows; what it is, in :attr:`facts`."""

    facts: InputFacts  # set once by each kind's constructor
    _class_weight: Any = None  # (y, sample_weight) -> sample_weight, from ``class_weight``

    # The facts every layer reads, by their names (read-only views of :attr:`facts`).
    kind = property(lambda self: self.facts.kind)
    rows = property(lambda self: self.facts.rows)
    reiterable = property(lambda self: self.facts.reiterable)
    row_numbers = property(lambda self: self.facts.row_numbers)
    shares = property(lambda self: self.facts.shares)
    graph_rewrites = property(lambda self: self.facts.graph_rewrites)
    batched = property(lambda self: self.facts.batched)
    infinite = property(lambda self: self.facts.infinite)
    rows_vary = property(lambda self: self.facts.rows_vary)
    _arity = property(lambda self: self.facts.arity)

    def rows_dataset(self, *, shuffle_seed: int | None = None,
                     epoch: int | tf.Variable = 0,
                     batch_size: int | None = None) -> tf.data.Dataset:
        """One epoch as ``tf.data`` batches of rows (leading dimension = rows).

        Args:
            shuffle_seed: where this input shuffles (:attr:`shuffles`), its order is
                ``(shuffle_seed, epoch)``'s alone: the same in every process and in
                every pipeline built for it.
            epoch: the epoch's number, for the seeded order; or an int64 variable
                holding it, which each iteration reads and advances by one (a
                pipeline repeated over epochs).
            batch_size: B, the large batch the rows are cut into; what arrays with
                ``shuffle="batch"`` shuffle within.
        """
        raise NotImplementedError

    def own_batch_rows(self) -> int | None:
        """The rows of each of the input's own batches but the last, where it comes in
        batches of one size that can be read (a batched ``tf.data`` pipeline); else
        None. ``model.fit`` validates such an input batch by batch."""
        return None

    @property
    def shuffles(self) -> bool:
        """Whether the order of the rows is ours to shuffle (arrays with ``shuffle``)."""
        return False

    def materialize(self, rows: Any) -> tuple:
        """A cut piece of ``rows_dataset`` elements -> ``(x, y_or_None, sample_weight_or_None)``."""
        if self._arity == 0:
            # x alone: a model whose loss comes from add_loss in call() (targets, if any,
            # are among its inputs). A 1-tuple element is x, as model.fit unpacks it.
            return (rows[0] if isinstance(rows, tuple) and len(rows) == 1 else rows), None, None
        x, y, *w = rows
        return self._weighted(x, y, w[0] if w else None)

    @property
    def weighting(self) -> Any:
        """``class_weight`` as ``(y, sample_weight) -> sample_weight``, or None."""
        return self._class_weight

    def _weighted(self, x: Any, y: Any, w: Any) -> tuple:
        """``(x, y, w)`` with ``class_weight`` applied to ``w``, where one was given."""
        return x, y, (w if self._class_weight is None else self._class_weight(y, w))

    def lengths(self) -> Lengths | None:
        """The lengths of this input's examples (``autosplit.data.sequences.lengths``):
        which parts vary in length, along which axis, and which share a length, as the
        first examples read show (the batches of a user's ``padded_batch``); read once.
        None where no part varies (rows of arrays: their sequences are
        :meth:`padded_sequences`)."""
        if self.row_numbers:
            return None
        if "_lengths" not in vars(self):
            found = lengths_of(self._parts(self.rows_dataset().element_spec))
            if found is not None and found.number > 1:
                # A dataset that shuffles moves its seed with this look, as with the
                # check's sample (``sample``): its first epoch's order is not model.fit's.
                found = tie(found, [self._parts(e) for e in self.first_elements()])
            vars(self)["_lengths"] = found
        return vars(self)["_lengths"]

    def _parts(self, element: Any) -> Any:
        """An element as ``(x, y[, sample_weight])``, whose leaves ``lengths`` counts: x
        alone (a model whose loss comes from add_loss) as ``(x,)``."""
        if self._arity == 0 and not (isinstance(element, tuple) and len(element) == 1):
            return (element,)
        return element

    def first_elements(self, rows: int = 256, most: int = 64) -> list:
        """The input's first elements as they come, up to ``rows`` rows or ``most``
        elements: what :meth:`lengths` reads."""
        found, seen = [], 0
        for element in self.rows_dataset():
            found.append(element)
            seen += int(tf.shape(tf.nest.flatten(element)[0])[0])
            if seen >= rows or len(found) >= most:
                break
        return found

    def padded_sequences(self, takes_any_length: bool) -> PaddedArrays | None:
        """How this input's rows of one shape hold padded sequences
        (``lengths.padded_sequences``); None but for arrays."""
        return None

    def sample(self, n: int) -> tuple:
        """Up to ``n`` leading examples as ``(x, y, sample_weight_or_None)`` tensors."""
        ds = self.rows_dataset().unbatch().take(n)
        ds = ds.padded_batch(n) if varying_shapes(ds.batch(1).element_spec) else ds.batch(n)
        for batch in ds:
            return self.materialize(batch)
        raise DatasetError(f"Expected a non-empty {self.kind}. Received: one with no example.")

    def on_epoch_begin(self) -> None:
        pass

    def on_epoch_end(self) -> None:
        pass

    @property
    def epoch_hooks(self) -> bool:
        """Whether this kind overrides ``on_epoch_begin``/``on_epoch_end`` (a
        ``PyDataset``'s), so each epoch needs an iterator of its own."""
        kind = type(self)
        return (kind.on_epoch_begin is not InputAdapter.on_epoch_begin
                or kind.on_epoch_end is not InputAdapter.on_epoch_end)


def class_weight_fn(class_weight: dict) -> Any:
    """``(y, sample_weight) -> sample_weight`` applying ``class_weight`` as ``model.fit`` does.

    Integer class ids, ``(n, 1)`` ids or one-hot rows (argmax); classes missing from the
    dict weigh 1.
    """
    if not isinstance(class_weight, dict) or not class_weight:
        raise DatasetError(
            f"Expected `class_weight` to be a non-empty dict of class id -> weight. Received: "
            f"class_weight={describe(class_weight)}.")
    table = tf.constant([float(class_weight.get(c, 1.0))
                         for c in range(int(max(class_weight)) + 1)], tf.float32)

    def apply(y, sample_weight):
        if tf.nest.is_nested(y):
            raise DatasetError("Expected one target for `class_weight`. Received: a nested y; "
                               "use sample weights for multi-output models.")
        ids = y
        if ids.shape.rank > 1:
            ids = tf.argmax(ids, axis=-1) if ids.shape[-1] != 1 else tf.squeeze(ids, -1)
        ids = tf.cast(tf.round(tf.cast(ids, tf.float32)), tf.int32)
        n = table.shape[0]
        picked = tf.gather(table, tf.clip_by_value(ids, 0, n - 1))
        weights = tf.where((ids >= 0) & (ids < n), picked, 1.0)
        return weights if sample_weight is None else sample_weight * weights

    return apply


def arity(element: Any) -> int | None:
    """How ``model.fit`` reads an element: (x, y) 2, (x, y, w) 3, x alone 0; else None."""
    if not isinstance(element, tuple):
        return 0
    return {1: 0, 2: 2, 3: 3}.get(len(element))


def check_class_weight_alone(class_weight, has_weights, y=None):
    """Refuse, before any pipeline is traced, what ``class_weight`` cannot apply to."""
    if class_weight is not None and has_weights:
        raise DatasetError(
            "Expected either `class_weight` or sample weights. Received: both. Fold the class "
            "weights into your sample weights, as model.fit also requires.")
    if class_weight is not None and tf.nest.is_nested(y):
        # Checked here, not only in the pipeline's map, where tracing wraps the error in
        # TensorFlow's StagingError.
        raise DatasetError(
            "Expected one target for `class_weight` (model.fit supports it for models with "
            "a single output). Received: nested targets. Pass per-output sample weights "
            "instead.")
