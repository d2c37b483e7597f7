"""Entry points; the only package that reads the command line, YAML and the environment."""
