"""(model, batch) -> the mean loss over the batch's unmasked tokens."""
