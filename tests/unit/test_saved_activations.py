"""scripts/saved_activations.py: what a compiled Llama layer stack saves for its backward, and how
``activation_memory_budget`` changes it (tiny widths, the 1B's layout)."""

from script_loader import load_script

TINY = dict(layers=2, tokens=48, embed_dim=64, intermediate_dim=256, num_heads=4, num_kv_heads=2)


def _mlp_wide(result):
    """Saved tensors as wide as the MLP's hidden layer (tokens x intermediate_dim)."""
    return sum(n for (shape, _), n in result["by_shape"] if shape == (TINY["tokens"], TINY["intermediate_dim"]))


def test_a_budget_below_one_recomputes_the_mlp_product_instead_of_saving_it():
    """Torch's default partition saves three MLP-wide tensors a layer (gate, up and
    silu(gate) * up, the down projection's input); at activation_memory_budget 0.7 two (the
    product is recomputed in the backward), and fewer bytes a token a layer in all."""
    script = load_script("saved_activations")
    default = script.saved_activations(1.0, **TINY)
    budget = script.saved_activations(0.7, **TINY)
    assert _mlp_wide(default) == 3 * TINY["layers"], default["by_shape"]
    assert _mlp_wide(budget) == 2 * TINY["layers"], budget["by_shape"]
    assert budget["bytes_per_token_per_layer"] < 0.8 * default["bytes_per_token_per_layer"]
    # the weights (MLP: 256 x 64 and 64 x 256) and the RoPE cache are state, not activations
    state = {(256, 64), (64, 256), (2048, 8, 2)}
    assert not state & {shape for (shape, _), _ in default["by_shape"]}, default["by_shape"]
