"""Entry points (train, evaluate, export_hf, plan, prepare_data), each a thin main();
the machinery lives in the subpackages, in layers: errors <- config <- analysis <-
instruments, checkpoints <- runtime <- entry points (docs/design.md, Layers of launch/)."""
