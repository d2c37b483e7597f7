"""Measurements of a running job: per-step metrics and wandb, the measured pipeline timeline,
collective counters. Imports launch/analysis/ and below, never launch/checkpoints/."""
