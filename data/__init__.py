"""Text -> tokenized, packed, data-parallel-sharded micro-batches. Imports nothing from launch."""
