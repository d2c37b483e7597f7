"""What a layout costs, computed without running it: parameter, FLOP, memory and
communication formulas, and the layout planner."""
