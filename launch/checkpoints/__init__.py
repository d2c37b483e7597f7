"""Checkpoints on disk: durable save, find and prune, safe loading, re-sharding to another
layout, transformers weights in and out. Imports launch/analysis/ and below, never
launch/instruments/."""
