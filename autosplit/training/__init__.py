"""``fit_large_batch`` (``fit``) and what it orchestrates: argument checks (``arguments``),
out-of-memory recovery (``recovery``) and validation (``evaluate``).
"""
