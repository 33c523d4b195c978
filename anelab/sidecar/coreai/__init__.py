"""Core AI sidecars (.aimodel): lowered from the saved Core ML program, written, inspected, run on coreai-core's CPU runtime."""
