"""scripts/saved_activations.py: what a compiled Llama layer stack saves for its backward, and how
``activation_memory_budget`` changes it (tiny widths, the 1B's layout)."""

from script_loader import load_script

TINY = dict(layers=2, tokens=48, embed_dim=64, intermediate_dim=256, num_heads=4, num_kv_heads=2)


def _mlp_wide(result):
    """Saved tensors as wide as the MLP's hidden layer (tokens x intermediate_dim)."""
    return sum(n for (shape, _), n in result["by_shape"] if shape == (TINY["tokens"], TINY["intermediate_dim"]))


def test_the_recipes_mlp_saves_two_mlp_wide_tensors_a_layer_and_torchtunes_three():
    """Torch's default partition of torchtune's MLP saves three MLP-wide tensors a layer (gate,
    up and silu(gate) * up, the down projection's input); at activation_memory_budget 0.7 two
    (the product recomputed in the backward). The recipes' compiled MLP saves two at torch's
    default budget: the product's bytes less, nothing else changed."""
    script = load_script("saved_activations")
    torchtune_default = script.saved_activations(1.0, **TINY, torchtune_mlp=True)
    torchtune_budget = script.saved_activations(0.7, **TINY, torchtune_mlp=True)
    ours = script.saved_activations(1.0, **TINY)
    assert _mlp_wide(torchtune_default) == 3 * TINY["layers"], torchtune_default["by_shape"]
    assert _mlp_wide(torchtune_budget) == 2 * TINY["layers"], torchtune_budget["by_shape"]
    assert _mlp_wide(ours) == 2 * TINY["layers"], ours["by_shape"]
    assert torchtune_budget["bytes_per_token_per_layer"] < 0.8 * torchtune_default["bytes_per_token_per_layer"]
    # ours: exactly the product less, one bf16 MLP-wide value a token a layer
    assert (torchtune_default["bytes_per_token_per_layer"] - ours["bytes_per_token_per_layer"]
            == 2 * TINY["intermediate_dim"])
    # the weights (MLP: 256 x 64 and 64 x 256) and the RoPE cache are state, not activations
    state = {(256, 64), (64, 256), (2048, 8, 2)}
    assert not state & {shape for (shape, _), _ in torchtune_default["by_shape"]}, torchtune_default["by_shape"]
