"""Measurements of a running job: per-step metrics and wandb, the measured pipeline timeline
and its chart, collective counters."""
