"""Checkpoints: how long a save blocks training, asynchronous against synchronous."""
