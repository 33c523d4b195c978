"""``anelab decide``: plan -> export -> verify -> whole-model arms -> (Mac) measure -> report, for one checkpoint
and prompt; the run (``run``) and its report (``report``, template in ``templates/``)."""
