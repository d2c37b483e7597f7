"""Parallel primitives (Megatron core's tensor_parallel/): the process groups of one topology, the
conjugate collectives of TP, SP, CP and EP, the column/row-parallel linears, the vocab-parallel
embedding and cross-entropy, and the deferred or fused weight gradients. Imports nothing else of model/."""
