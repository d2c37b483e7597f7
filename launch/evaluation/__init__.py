"""Scoring weights: loss and perplexity of a checkpoint or transformers weights at any
layout (launch/evaluate.py), and what the training loop also scores: validation loss
(validation.py, the same mean loss) and the multiple-choice tasks.
Imports launch/engine/, launch/feed/ and below; a sibling of launch/autotune/."""
