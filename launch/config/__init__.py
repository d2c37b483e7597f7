"""What a run is, before anything runs: the recipe's typed sections (each validating itself) and
the layout derived from them at a (world size, tp, pp). Imports only launch/errors.py."""
