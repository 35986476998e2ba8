"""The probe: the pure search over micro-batch sizes and the shrink rule after an
out-of-memory error (``policy``), real trial steps
(``trials``), trials in a child process (``isolation``) and the result cache
(``cache``).
"""
