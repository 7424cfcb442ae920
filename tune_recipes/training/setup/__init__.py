"""Building a run: where it runs, the model, sharding, data, QAT, and the step driver."""
