"""OmegaConf resolvers the shipped configs use, registered once when ``tune_recipes`` is imported.

``${tiny_checkpoint:}`` builds (once) and returns the deterministic tiny checkpoint;
``${tiny_checkpoint:teacher}`` a second one from another seed (a distillation teacher). The demo
model is imported only when a config actually resolves the interpolation.
"""

from typing import Optional

from omegaconf import OmegaConf


def tiny_checkpoint(variant: Optional[str] = None) -> str:
    from tune_recipes.models.tiny import build_tiny_llama3_checkpoint

    return str(build_tiny_llama3_checkpoint(variant=variant or "base"))


def register() -> None:
    # omegaconf 2.4 renamed the registration call; 2.3 only has the old name.
    reg = getattr(OmegaConf, "register_resolver", None) or OmegaConf.register_new_resolver
    reg("tiny_checkpoint", tiny_checkpoint, replace=True)
