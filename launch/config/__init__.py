"""What a run is, before anything runs: the recipe's typed sections (each validating itself), the
layout derived from them at a (world size, tp, pp), and the command line that picks the recipe and
overrides its fields (cli.py, every entry point's parser). Imports only launch/errors.py."""
