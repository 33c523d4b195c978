"""macOS only: the Core ML runtime behind an interface, its fake, the ANE gate, use-time refusals,
timing, verification on the device and the doctor. Nothing outside this package imports Core ML's runtime."""
