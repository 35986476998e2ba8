"""``Cut``: how a run cuts its large batches, its reason derived from its fields, and
changed only through its own methods."""

from __future__ import annotations

import ast
from pathlib import Path

import autosplit
from autosplit.data.sequences.cut import Cut
from autosplit.data.sequences.lengths import Lengths

TWO_LENGTHS = Lengths((1, 1), (0, 1), ("x[0]", "x[1]"))


def test_the_reason_is_derived_from_what_the_cut_is():
    assert Cut().why is None
    assert Cut("longest", found="the model does not ignore padding: x").why == (
        "to the large batch's longest row: the model does not ignore padding: x")
    assert Cut("length", found="the same loss").why == (
        "by length: the model ignores padding (the same loss)")
    xla = Cut("length", TWO_LENGTHS, buckets=True, replicas=2, found="f")
    assert xla.why == (
        "by length (under XLA each length rounded up to a bucket: 8, 16, 24, 32, 40, 56, "
        "... each 1.25x) on 2 replicas, each a micro-batch of its own shape: 2 lengths per "
        "example, the model ignores padding (f)")
    tokens = xla.in_tokens(512)
    assert tokens.why.startswith("by length (under XLA each length rounded up to a bucket: "
                                 "8, 16, 32, 56, 96, 160, ... each 1.6x; rows to what the "
                                 "budget holds there, or half)")
    assert tokens.why.endswith("; micro-batches of up to 512 tokens")
    assert tokens.shared(2).why.endswith(
        "micro-batches of up to 512 tokens; each of 2 workers reads and cuts its own share")


def test_each_change_of_a_cut_is_a_method_of_its_own():
    found = Cut("length", found="f")
    assert found.in_tokens(None) == found._replace(by="tokens")
    budget = found.in_tokens(None).with_budget(300)
    assert (budget.by, budget.tokens, budget.packing) == ("tokens", 300, "least_work")
    assert budget.with_budget(300, packing="fullest").packing == "fullest"
    assert budget.shrunk(4).tokens == 75 and budget.shrunk(1000).tokens == 1
    assert found.shrunk(4) == found  # in rows: as it was
    assert budget.in_rows() == found
    assert budget.shared(3).workers == 3


def test_a_cut_is_changed_in_its_own_module_only():
    # A Cut is decided once; every later change is one of its methods, in cut.py. Other
    # NamedTuples a module may _replace: an example's Lengths, a step's Totals.
    package = Path(autosplit.__file__).parent
    outside = []
    for path in sorted(package.rglob("*.py")):
        if path == package / "data" / "sequences" / "cut.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "_replace"
                    and not (isinstance(node.func.value, ast.Name)
                             and node.func.value.id in ("lengths", "totals"))):
                outside.append(f"{path.relative_to(package)}:{node.lineno}")
    assert not outside, outside


def test_programs_are_bounded_by_the_buckets():
    assert Cut("tokens", buckets=True, tokens=4096).programs(512) == 18
    assert Cut("length", buckets=True).programs((60, 60)) == 49
    assert Cut("length").programs(512) is None
