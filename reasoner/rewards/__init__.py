"""Rewards: each a function `(prompts, completions, **batch) -> list[float]`. `builtin` holds
those that need no model, `judge` a model's grade of each completion, and `scoring` the routing
of a batch's rows to the rewards of their category and the weighted total. A new reward (a
rubric, a sandbox) is a module here."""
