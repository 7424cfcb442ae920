"""tune-recipes: the small library behind our fine-tuning recipes.

Anything with one correct answer (token accounting, gradient scaling, checkpoint I/O, metrics)
lives here once; the scripts in ``recipes/`` keep only control flow.
"""

from tune_recipes import resolvers as _resolvers

_resolvers.register()

__version__ = "0.1.0"
