"""The run's machinery between the command line and the model: command line, preflight,
DeepSpeed config, distributed start, engine, training loop, evaluation, signals and failures.
The top layer under the entry points: it may import every other subpackage of launch/."""
