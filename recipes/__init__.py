"""Training recipes run on each rank by `python -m recipes.run RECIPE_YAML`.

Owns: the sft / dpo / cp trainers on TRL (one `main(cfg) -> dict` each), the built-in tiny models
(`recipes.tiny`), the shipped demo data and example configs. Importing this package is cheap:
heavy libraries (torch, transformers, trl, deepspeed) are imported inside functions only.
"""
