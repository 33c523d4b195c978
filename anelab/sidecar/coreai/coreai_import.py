"""coreai-core (Apple's Core AI Python package, module ``coreai``) imported in the order its beta needs.

coreai-core 1.0.0b3 breaks with a circular import when ``coreai._compiler.dialects`` is imported
before ``coreai.authoring`` (``authoring.constant`` imports a half-initialised
``_compiler.dialects.coreai.constant``), so ``coreai_modules`` imports the authoring facade first.
"""

from __future__ import annotations

from types import SimpleNamespace

from anelab.core.errors import AnelabInputError

COREAI_DISTRIBUTION = "coreai-core"
# coreai-core 1.0.0b3 has wheels for Linux and macosx_26_0_arm64 only: on macOS 15 there is nothing to install
COREAI_INSTALL = "pip install -e '.[coreai]' on macOS 26+ (Apple silicon; coreai-core has no macOS 15 wheel)"


def coreai_modules() -> SimpleNamespace:
    """The modules anelab uses: ``authoring`` (the facade), ``constant`` (the facade's constant op: the
    name ``coreai.authoring.constant`` is the sub-module, not the function), ``dialect`` (the raw dialect:
    handles, tokens, the graph terminator), ``GraphOp`` and ``runtime``. Refused in one line without it."""
    try:
        import coreai.authoring as authoring  # first: see the module docstring
        import coreai.runtime as runtime
        from coreai._compiler.dialects import coreai as dialect
        from coreai.authoring.constant import constant
        from coreai.authoring.graph_builder import GraphOp
    except ImportError as e:
        raise AnelabInputError(
            f"the Core AI backend needs {COREAI_DISTRIBUTION} (module coreai), which is not installed here: {COREAI_INSTALL} "
            f"({type(e).__name__}: {e})"
        ) from None
    return SimpleNamespace(authoring=authoring, constant=constant, dialect=dialect, GraphOp=GraphOp, runtime=runtime)


def coreai_version() -> str:
    """The installed coreai-core version ("unavailable" without it)."""
    try:
        from coreai import _version

        return str(_version.__version__)
    except ImportError:
        return "unavailable"
