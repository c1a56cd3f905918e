"""Cloud TPU deployment: the recipes' tooling (``launch/recipes``), their scripts and docs."""
