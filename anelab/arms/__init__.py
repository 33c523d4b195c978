"""Whole-model arms: the model prefilled and decoded with every full-attention layer on its saved sidecar (or a
perturbed reference) beside the reference, weights streamed once for all arms, compared per layer and on the
logits and greedy text."""
