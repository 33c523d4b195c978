"""The Core ML runtime on macOS and its fake: the ANE gate, assumptions, probe, load/predict timing, the block A/B, device verify."""
