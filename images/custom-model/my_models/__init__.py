"""An example model package for the custom-model image: ``model.factory: my_models.gpt:build_model``."""
