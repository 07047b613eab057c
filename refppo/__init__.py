"""refppo: a readable, tested reference implementation of PPO for language-model RLHF."""

__version__ = "0.1.0"
