"""The MIL evaluator: a saved package's program run with NumPy on any OS (kernels, online-softmax steps)."""
