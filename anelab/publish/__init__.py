"""Running and publishing the studies: the table of studies, notebook runs and batches, figures with their
captions and MANIFEST, headlines, fresh Mac records (``measure``), records compare, the docs gallery and its
browser check, the doctor, ``reproduce``."""
