"""What keeps a long run honest when something goes wrong: one line per rank when any rank
fails, heartbeats, the hang watchdog and its one line, SIGTERM / SIGINT agreed and saved, the cap
on requeued starts without progress, and the clock every timer reads. Imports launch/checkpoints/
and below, never the engine: a test drives it with a simulated clock (tests/helpers/simulated_clock.py)."""
