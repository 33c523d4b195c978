"""Core ML sidecars on any OS: package format, graph designs, export, MIL evaluation from disk,
comparison with the reference, the prompt driver, verification and the fold check."""
