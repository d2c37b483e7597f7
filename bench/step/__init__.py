"""What a training step costs: tokens/s, where its time goes, the pipeline bubble, the bytes its
collectives move, the planner's prediction against the measured time."""
