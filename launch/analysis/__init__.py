"""What a layout costs and how it runs, computed without running it: parameter, FLOP, memory
and communication formulas, where the pipeline is cut, the ZB-H1 schedule and its simulator,
the schedule charts and the layout planner. Imports only launch/config/ and launch/errors.py."""
