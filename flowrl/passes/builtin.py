"""The built-in pass pipeline, in order. Each import registers one pass."""
