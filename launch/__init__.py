"""Entry points (train, evaluate, export_hf, plan, prepare_data), each a thin main();
the machinery lives in the subpackages, one idea each, in layers: errors <- config <- analysis
<- instruments, checkpoints <- optim, resilience, feed <- engine <- autotune, evaluation <- trainer
<- entry points (docs/design.md, Layers of launch/; tests/model/test_imports.py enforces them)."""
