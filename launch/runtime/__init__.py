"""The run's machinery between the command line and the model: recipe, layout, DeepSpeed
config, distributed start, engine, training loop, evaluation, signals and failures."""
