"""``python -m refppo sft|rm|ppo ...``: the same as the ``refppo`` command."""

from refppo.cli import main

raise SystemExit(main())
