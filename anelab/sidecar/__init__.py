"""Core ML sidecars on any OS: package format, the design registry and its graphs, export, MIL evaluation
from disk, comparison with the reference, the prompt drivers, verification and the fold check."""
