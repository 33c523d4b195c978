"""Hugging Face checkpoints: config.json -> geometry, safetensors I/O, layer loading and writing,
and the embedded default checkpoint."""
