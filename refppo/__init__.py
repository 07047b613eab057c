"""refppo: a readable, tested reference implementation of PPO for language-model RLHF."""

# verl's other estimators and losses register themselves when imported: here, so that the registries
# (refppo.advantages.ADV_ESTIMATORS, refppo.losses.POLICY_LOSSES) hold every name whichever
# refppo module is imported first.
from refppo.algorithms import bypass, divergence_losses, verl_advantages, verl_losses  # noqa: F401

__version__ = "0.1.0"
