"""The checks of a saved sidecar: verify (per design, per export directory), comparisons with the reference, the fold check."""
