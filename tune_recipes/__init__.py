"""tune-recipes: the small library behind our fine-tuning recipes.

Anything with one correct answer (token accounting, gradient scaling, checkpoint I/O, metrics)
lives here once; the scripts in ``recipes/`` keep only control flow.
"""

from tune_recipes import resolvers as _resolvers

_resolvers.register()

__version__ = "0.1.0"

# Before anything imports torchao/torchtune/torchdata: drop their import-time and per-run notices
# we cannot act on (each one is named in tune_recipes/_cli/quiet.py; TUNE_RECIPES_VERBOSE=1 keeps
# them). Cheap: logging and warnings only.
from tune_recipes._cli import quiet as _quiet  # noqa: E402

_quiet.install()
