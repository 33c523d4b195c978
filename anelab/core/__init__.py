"""Core: one attention block's geometry, RoPE, weights, masks, the indexer, the NumPy reference (block and
whole-model forward), fp16 emulation, records, paths, errors, progress and the core budget. Imports nothing
else of anelab."""
