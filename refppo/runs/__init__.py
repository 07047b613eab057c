"""Runs and the command line: ``refppo sft|rm|ppo`` (``cli``), run folders, their logs and
resumption (``folder``), the chapters' run cache (``run_cache``), loggers (``loggers``), plots
(``plots``), the run doctor (``doctor``) and the preflight size checks (``sizes``).

The top layer: it may import every other; nothing imports it."""
