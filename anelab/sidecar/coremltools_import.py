"""coremltools imported quietly (its import warnings and pass progress bars go to stderr)."""

from __future__ import annotations

import contextlib
import io


@contextlib.contextmanager
def quiet_coremltools():
    """Silence coremltools' import warnings and pass progress bars (they go to stderr)."""
    with contextlib.redirect_stderr(io.StringIO()):
        yield


def coremltools_modules():
    """(ct, mb, types) imported quietly."""
    with quiet_coremltools():
        import coremltools as ct
        from coremltools.converters.mil import Builder as mb
        from coremltools.converters.mil.mil import types
    return ct, mb, types
