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


def _block_operations(block):
    """Every operation of ``block`` and of the blocks nested in its operations, depth first."""
    for op in block.operations:
        for inner in op.blocks:
            yield from _block_operations(inner)
        yield op


def propagate_nonreplaceable_vars(block) -> None:
    """coremltools 9.0's ``Block._propagate_nonreplaceable_vars`` (run each time a pass leaves a ``with block:``),
    with its outcome reached directly where it is known.

    coremltools recomputes, for every op output of the block, the set of ``constexpr_*`` outputs upstream of it (a
    var may only be replaced by one that carries the same): each output is reset, then given the union of its
    inputs' sets. Only a ``constexpr_*`` output starts a non-empty set, and a var no op produces (a function's or a
    nested block's input) keeps the empty set it was made with. So in a function whose operations hold no
    ``constexpr_*`` op — every fp16 conversion of a sidecar's program — every set comes out empty: here they are
    emptied without the unions (coremltools' walk was a fifth of an export's CPU under a profiler; skipping it and
    convert's closing gc.collect, as ``fast_conversions`` does, took 17 % off notebook 05's exports). Any other block — one holding a
    ``constexpr_*`` op (a compression), a nested block reading its parent's vars, a block input that carries a set —
    goes through coremltools' own walk."""
    from coremltools.converters.mil.mil.block import Function

    if not isinstance(block, Function) or any(v.nonreplaceable_vars_upstream for v in block.inputs.values()):
        return _coremltools_propagate()(block)
    ops = list(_block_operations(block))
    if any(op.op_type.startswith("constexpr_") for op in ops) or any(
        v.nonreplaceable_vars_upstream for op in ops for inner in op.blocks for v in inner.inputs
    ):
        return _coremltools_propagate()(block)
    for op in ops:
        for var in op.outputs or ():
            if var.nonreplaceable_vars_upstream:
                var.nonreplaceable_vars_upstream = set()
    return None


_COREMLTOOLS_PROPAGATE = []  # coremltools' own Block._propagate_nonreplaceable_vars, kept at first use


def _coremltools_propagate():
    """coremltools' own ``Block._propagate_nonreplaceable_vars`` (kept the first time it is asked for, which is
    before ``fast_conversions`` first replaces it)."""
    if not _COREMLTOOLS_PROPAGATE:
        from coremltools.converters.mil.mil.block import Block

        _COREMLTOOLS_PROPAGATE.append(Block._propagate_nonreplaceable_vars)
    return _COREMLTOOLS_PROPAGATE[0]


class _NoCollection:
    """Stands in for the ``gc`` module inside coremltools' ``convert``: its ``collect`` does nothing."""

    @staticmethod
    def collect(*_args) -> int:
        return 0


@contextlib.contextmanager
def fast_conversions():
    """Within the block, coremltools converts and compresses the same packages with less CPU — when the installed
    coremltools is the one the shortcuts mirror (``PIPELINE_MIRRORED_FOR``); any other runs as it is:

    - its pass pipelines run through ``apply_pipeline_validated_at_cleanups``;
    - its blocks propagate their non-replaceable vars through ``propagate_nonreplaceable_vars``;
    - ``ct.convert`` skips the full garbage collection it starts at its end (``gc.collect()``: ~85 ms with an
      export's objects alive, a fifth of a small function's conversion). Python's own collector still runs; a
      collection frees memory and changes no result.
    """
    ct, _, _ = coremltools_modules()
    if ct.__version__ != PIPELINE_MIRRORED_FOR:
        yield
        return
    from unittest import mock

    from coremltools.converters import _converters_entry
    from coremltools.converters.mil.mil.block import Block
    from coremltools.converters.mil.mil.passes.pass_pipeline import PassPipelineManager

    _coremltools_propagate()  # kept before it is replaced
    with (
        mock.patch.object(PassPipelineManager, "apply_pipeline", staticmethod(apply_pipeline_validated_at_cleanups)),
        mock.patch.object(Block, "_propagate_nonreplaceable_vars", propagate_nonreplaceable_vars),
        mock.patch.object(_converters_entry, "gc", _NoCollection),
    ):
        yield
