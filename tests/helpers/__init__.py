"""What the tests share (docs/testing.md, Helpers): starting runs as a user does (launcher), forking
ranks from one warm process (forked, rank_server, distributed), reading what runs wrote (step_clock,
chart_pixels, flop_count), local data and servers (stream_corpus, stream_steps, range_server), and TP/EP groups
faked for the layers' constructors (fake_groups). tests/ is on sys.path as pytest's rootdir
conftest puts it, so every test imports these as `helpers.<name>`."""
