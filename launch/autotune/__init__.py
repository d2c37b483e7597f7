"""Choosing a layout by measuring this machine: the device profile (--calibrate), the planner's
pick for these processes (--layout auto), the K fastest predicted layouts measured
(--auto-sweep), and the planner's step time for the run's layout. Imports launch/engine/ and
below; a sibling of launch/evaluation/, which it never imports."""
