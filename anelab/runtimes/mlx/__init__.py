"""MLX as a runtime: mlx-lm's own model of a checkpoint (the GPU runtime Mac users run; its CPU build here), and
the hybrid whose softmax-attention layers' prefill chunks are served by their sidecars."""
