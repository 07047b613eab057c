"""verl's other algorithms, beside the teaching core's: its other advantage estimators
(``verl_advantages``) and policy losses (``verl_losses``, ``divergence_losses``), rollout correction
(``rollout_correction``) and DAPO's overlong shaping (``overlong``), each equal to verl 0.9's code.

They register themselves in the core's registries when imported (``refppo/__init__.py`` imports
them). They may import the core and ``guards``; nothing above."""
