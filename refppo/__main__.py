"""``python -m refppo sft|rm|ppo ...``: the same as the ``refppo`` command."""

from refppo.cli import entry

raise SystemExit(entry())
