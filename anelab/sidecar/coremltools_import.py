"""coremltools imported quietly (its import warnings and pass progress bars go to stderr), and its models saved
without leaving their temporary packages behind."""

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


def save_model(model, dest) -> None:
    """``model.save(dest)``, then its temporary package (coremltools converts into one under $TMPDIR and removes
    it only at interpreter exit) removed at once: an export of 48 functions holds one, not 48."""
    import shutil

    try:
        model.save(str(dest))
    finally:
        if getattr(model, "is_temp_package", False) and getattr(model, "package_path", None):
            shutil.rmtree(model.package_path, ignore_errors=True)
