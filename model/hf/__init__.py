"""Conversions between our weights and transformers' GPT-2, Llama and MoE families: name and
layout rules, merge and split over TP and EP, and per-rank read plans of sharded safetensors."""
