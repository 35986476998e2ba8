"""Sequences cut by length on several local replicas: each replica takes a row of every
R of a large batch's sorted rows, in rows cut by length and in micro-batches of a token
budget, and the run trains as model.fit's full batch on one device
(``replicas_child.py``, on two logical CPU devices)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from _sequences import B, cut_by_length, dataset, sequences
from common import child_env

from autosplit.data.inputs import get_input
from autosplit.data.layout import Layout
from autosplit.data.markers import is_end_marker
from autosplit.data.pipeline import MicroBatches

TWO = Layout(workers=1, worker=0, local_replicas=2, replicas=2)


@pytest.mark.parametrize("tokens", [None, 160])
def test_each_replica_takes_a_row_of_every_two_sorted_rows_padded_to_their_longest(tokens):
    # 185 rows: the last large batch has 57, one replica a row short (a copy, valid 0).
    seqs = sequences(185)
    adapter = get_input(dataset(seqs, "gru").padded_batch(16))
    cut = cut_by_length(adapter, tokens=tokens, replicas=2)
    rows = []
    for x, _, _, valid in MicroBatches(adapter, B, 8, TWO, cut=cut).dataset():
        if is_end_marker((valid,)):
            continue
        ids, valid = x.inputs.numpy(), valid.numpy()
        assert ids.shape[0] == 2 and ids.shape[1] <= (8 if tokens is None else 160)
        real = [np.trim_zeros(r, "b") for r in ids[valid > 0]]
        assert ids.shape[2] == max(len(r) for r in real)  # the run's longest, no more
        if tokens is not None:
            assert ids.shape[1] == 1 or ids.shape[1] * ids.shape[2] <= tokens
        rows += [tuple(r) for r in real]
    assert sorted(rows) == sorted(tuple(s) for s in seqs)  # every row once, copies 0


@pytest.fixture(scope="module")
def found():
    run = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("replicas_child.py"))],
        env=child_env(PYTHONPATH=os.pathsep.join([child_env()["PYTHONPATH"],
                                                  str(Path(__file__).parent)])),
        capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # one child trains 6 cases on two replicas (1-2 minutes)
@pytest.mark.parametrize("case", ["rows", "tokens", "per_token", "pairs_gru",
                                  "pairs_transformer"])
def test_two_replicas_cut_by_length_train_as_model_fit_with_half_the_padding(found, case):
    # The child asserted the weights, iterations and logs against model.fit.
    got = found[case]
    assert got["padding"].startswith("by length on 2 replicas"), got
    assert got["padding_share"] <= got["full"] / 2, got


@pytest.mark.slow
def test_two_replicas_take_micro_batches_in_tokens_given_or_found(found):
    assert found["rows"]["tokens"] is None
    assert found["tokens"]["tokens"] == found["per_token"]["tokens"] == 160
    # The probe's budget is this machine's (about a third of a replica's rows at the
    # longest length on 2 cores): the least-work cut then makes few micro-batches, and
    # its padding is that trade's (0.33 against the large batch's 0.64), not bounded here.
    auto = found["auto"]
    assert auto["tokens"] is not None and auto["tokens"] > 0, auto
    assert auto["padding"].startswith("by length on 2 replicas"), auto
    assert auto["padding_share"] < auto["full"], auto
