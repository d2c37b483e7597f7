"""The optimizers against each other: Muon's step under TP, and Muon against AdamW on one recipe."""
