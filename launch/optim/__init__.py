"""The optimizer family: Muon (its matrices, its owner ranks under ZeRO-1 and TP, the
Newton-Schulz iteration), the learning-rate schedule, the ZeRO-0 gradient norm and the fp32 main
gradients of bf16 accumulation. What a new optimizer touches, beside the recipe. Imports
launch/analysis/ and launch/config/; nothing else of launch/."""
