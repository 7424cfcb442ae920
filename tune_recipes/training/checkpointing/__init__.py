"""Checkpoint I/O around torchtune's checkpointers, the recipe state, the checkpoint writer."""
