"""The data pipeline against the model that consumes it: tokenizing, loading, mixtures, streaming
over HTTP."""
