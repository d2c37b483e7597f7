"""The training run: every check before the first collective (start-up, preflight), then the
loop (steps, validation, saves, metrics). The top layer under the entry points: it may import
every other subpackage of launch/."""
