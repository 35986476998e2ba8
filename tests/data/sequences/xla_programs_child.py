"""Trains a per-token language model under XLA on lengths up to 512, in micro-batches of
a token budget and in rows cut by length, with XLA's dumps on: prints, as JSON, what
``FitReport.programs`` counted and the modules XLA compiled for the step, read from its
dump folder (``XLA_FLAGS=--xla_dump_to``, set by the parent before TensorFlow starts).

Run by ``tests/data/test_xla_tokens.py``: ``python xla_programs_child.py DUMP_FOLDER``.
"""

from __future__ import annotations

import json
import pathlib
import sys

from _sequences import dataset, model_of, sequences

import autosplit


def compiled(folder: pathlib.Path, seen: set[str]) -> int:
    """Modules XLA compiled for the step's per-micro-batch function since ``seen``."""
    found = {path.name.split(".")[0] for path in folder.glob("module_*contribute*")
             if path.name.endswith(".before_optimizations.txt")}
    new = found - seen
    seen |= found
    return len(new)


def main(folder: pathlib.Path) -> None:
    seqs = sequences(384, median=60, longest=512)
    seen: set[str] = set()
    report = {"longest": max(len(s) for s in seqs)}
    for name, options in (("tokens", {"micro_batch_tokens": 4096}),
                          ("rows", {"micro_batch_size": 16})):
        got = autosplit.fit_large_batch(
            model_of("lm_sample_weight", jit_compile=True),
            dataset(seqs, "lm_sample_weight").padded_batch(32), batch_size=128, epochs=2,
            verbose=0, **options)
        report[name] = {"programs": got.autosplit.programs, "compiled": compiled(folder, seen),
                        "padding_share": got.autosplit.cut.padding_share}
    print(json.dumps(report))


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]))
