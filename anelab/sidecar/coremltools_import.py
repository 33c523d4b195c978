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


PIPELINE_MIRRORED_FOR = "9.0"  # the coremltools whose PassPipelineManager.apply_pipeline the one below mirrors


def apply_pipeline_validated_at_cleanups(prog, pass_pipeline) -> None:
    """coremltools 9.0's ``PassPipelineManager.apply_pipeline``, validating the program at its first state, after
    each dead-code elimination (with the essential-scope check, as coremltools does there) and after the last
    pass, instead of after every pass.

    The same passes run in the same order with the same options, so the program is the same: ``Program.validate``
    only reads (it raises on a broken program, it changes nothing). What it saves is coremltools' re-validation
    after each of the ~95 default passes (~0.5 s of CPU per four-function layer, a third of a sidecar export) and
    the debug logging's string of the whole program that coremltools formats before and after every pipeline
    whether debug logging is on or not. Not kept: coremltools' refusal of a pass that breaks the program when a
    later pass mends it (the last pass's program is validated either way)."""
    import logging

    from coremltools.converters.mil.mil.passes.pass_registry import PASS_REGISTRY

    if pass_pipeline is None:
        raise ValueError("The pass_pipeline cannot be None.")
    pass_pipeline.validate()
    prog.validate()
    logger = logging.getLogger("coremltools")
    names = list(pass_pipeline.passes)
    for index, name in enumerate(names):
        if name.startswith("experimental::"):
            logger.warning(f"The graph pass {name} is under experimental development, and the API could change.")
        graph_pass = PASS_REGISTRY[name]
        graph_pass.set_options(pass_pipeline.get_options(name))
        graph_pass(prog)
        cleanup = name == "common::dead_code_elimination"
        if cleanup or index == len(names) - 1:
            prog.validate(check_essential_scope=cleanup)


@contextlib.contextmanager
def pipelines_validated_at_cleanups():
    """Within the block, coremltools' pass pipelines run through ``apply_pipeline_validated_at_cleanups`` — when the
    installed coremltools is the one it mirrors (``PIPELINE_MIRRORED_FOR``); any other runs coremltools' own."""
    ct, _, _ = coremltools_modules()
    if ct.__version__ != PIPELINE_MIRRORED_FOR:
        yield
        return
    from unittest import mock

    from coremltools.converters.mil.mil.passes.pass_pipeline import PassPipelineManager

    with mock.patch.object(PassPipelineManager, "apply_pipeline", staticmethod(apply_pipeline_validated_at_cleanups)):
        yield
