"""Scoring weights: loss and perplexity of a checkpoint or transformers weights at any
layout (launch/evaluate.py), and the multiple-choice tasks the training loop also scores.
Imports launch/engine/, launch/feed/ and below; a sibling of launch/autotune/."""
