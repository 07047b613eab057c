"""The run's settings: each declared once, beside its default and its valid values (``config``,
with ``declare`` and ``conditions``); their checks, refusals and help (``validate``); the command
line's overrides (``overrides``); and verl 0.9's keys by what refppo does with each
(``verl_keys``), its names read on a command line (``verl_names``) and its defaults (``verl_map``).

They may import the core (for the registries' names), ``guards``, ``algorithms`` and ``tasks``;
nothing above."""
