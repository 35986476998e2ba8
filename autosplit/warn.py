"""Warnings that point at the user's line, however deep in autosplit they are raised.

``warnings.warn(..., stacklevel=n)`` counts frames by hand, and a refactor that moves
the call one function deeper silently points the warning at autosplit's own code (and
its once-per-location filter then hides a second call's warning from another line).
:func:`warn_user` finds the first frame outside the package instead, as Python 3.12's
``skip_file_prefixes`` does.
"""

from __future__ import annotations

import os
import sys
import warnings

__all__ = ["warn_user"]

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def warn_user(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn(message, category)`` attributed to the first caller outside autosplit."""
    level = 2  # 1 is this function; 2 its caller
    frame = sys._getframe(1)
    while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith(
            _PACKAGE):
        frame = frame.f_back
        level += 1
    warnings.warn(message, category, stacklevel=level)
