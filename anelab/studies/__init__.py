"""Notebook back-ends, one module per study notebook, named after it (``publish.studies.STUDIES`` lists them)."""
