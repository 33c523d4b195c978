"""Runtimes: the Core ML runtime behind an interface (macOS only; a fake elsewhere), the ANE gate, use-time
refusals, load/predict timing and the attention-block A/B, verification on the device, the probe of Core ML's
behaviours. Nothing outside this package imports Core ML's runtime."""
