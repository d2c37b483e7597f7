"""What the engine is fed: the run's checked tokenizer and data, one reader per replica for
streamed data, and each step's counted tokens (the loss's token mean, the routers' masks).
Imports launch/config/ and launch/errors.py (and model/, data/); nothing else of launch/."""
