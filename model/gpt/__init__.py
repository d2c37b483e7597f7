"""The whole model from its blocks: the layer table (one order for the dense model and the
pipeline), the dense GPT (the reference for tests, evaluation and export), the DeepSpeed
PipelineModule of the same layers, and compiled blocks."""
