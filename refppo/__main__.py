"""``python -m refppo sft|rm|ppo ...``: the same as the ``refppo`` command."""

from refppo.runs.cli import entry

raise SystemExit(entry())
