"""Sequences of varying length: an example's lengths, and the cuts of a large batch of
them, padded to its longest row or by length, in rows or in tokens."""
