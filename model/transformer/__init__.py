"""The transformer's parts on the parallel primitives: attention (GPT-2 multi-head, Llama's
grouped-query, Ulysses around the core), positions and document masks, norms, the dense and
mixture-of-experts MLPs, and the pre-norm block that holds them."""
