"""anelab: should a model's prefill attention move to the Apple Neural Engine?

The path through the package reads in a straight line:
geometry -> checkpoint -> graph -> export (package) -> mil_eval (inspect/evaluate) -> verify.
"""

__version__ = "0.1.0"
