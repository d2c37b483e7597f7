"""The DeepSpeed engine of a run and what it is built from: torch.distributed's start, the
DeepSpeed config, the PipelineModule and its optimizer, expert parallelism's groups, ZB-H1's
handlers, whether torch.compile can run, and the console noise DeepSpeed makes. Imports
launch/optim/ and the layers below it."""
