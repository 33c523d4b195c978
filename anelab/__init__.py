"""anelab: should a model's prefill attention move to the Apple Neural Engine?

The path through the package reads in a straight line:
geometry -> checkpoint -> graph -> export (package) -> sidecar.mil (inspect/evaluate) -> sidecar.checks (verify).
"""

__version__ = "0.1.0"


def _quiet_missing_native_runtime() -> None:
    """Off-Mac, coremltools logs one 'Failed to load _ML...Proxy' warning per native class at
    import; anelab reports the missing runtime itself (``anelab doctor``), so drop those lines."""
    import logging
    import sys

    if sys.platform == "darwin":
        return

    class _DropProxyWarnings(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            return not str(record.getMessage()).startswith("Failed to load _ML")

    for name in ("coremltools", "coremltools.models.model", "coremltools.models.compute_plan"):
        logging.getLogger(name).addFilter(_DropProxyWarnings())


_quiet_missing_native_runtime()
