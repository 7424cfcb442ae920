"""One optimizer step: batches, the normalization path, optimizers, the step driver."""
