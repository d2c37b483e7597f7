"""Bytes held, measured against the formula or bound that predicts them: activations, logits, the
host memory of loading transformers weights and of a re-sharded resume."""
