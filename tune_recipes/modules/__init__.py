"""Model-side building blocks: losses and model-output adapters."""
