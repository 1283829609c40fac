"""The LLaMA model: its named shapes (framework-free), the Flax module, its sharding."""
