"""Sequences cut by length on several local replicas: each replica takes a row of every
R of a large batch's sorted rows (``test_pieces.py`` reads the pieces), in rows cut by
length and in micro-batches of a token budget, and the run trains as model.fit's full
batch on one device (``replicas_child.py``, on two logical CPU devices)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from common import child_env


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
