"""``fit_large_batch`` and what it orchestrates: arguments, plan, epochs, recovery, report."""
