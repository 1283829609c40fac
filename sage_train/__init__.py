"""Flax LLaMA trainer for the sage-optim optimizers (data pipeline, model, training loop)."""
