"""``trio-sglang`` on the command line: the parser, each command's run, the engine factory."""
