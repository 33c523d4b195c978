"""Checkpoints: a model on disk -> geometry and weights in anelab's layout (config -> geometry through the
family table, safetensors I/O, layer and whole-model loading and writing, the embedded checkpoints)."""
