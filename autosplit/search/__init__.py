"""The probe: the pure search over micro-batch sizes (``policy``), real trial steps
(``trials``), trials in a child process (``isolation``) and the result cache
(``cache``).
"""
