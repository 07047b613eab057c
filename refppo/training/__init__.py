"""Training: the PPO trainer and its step (``trainer``, ``update``, ``fit``), SFT and the reward
model (``sft``, ``reward_model``), the optimiser (``optim``), data (``data``, ``user_data``),
metrics and validation (``metrics``, ``validation``), DAPO's dynamic sampling
(``dynamic_sampling``), reward functions (``reward_fns``) and the checkpoints' model states
(``checkpoint``).

They may import every layer below: the core, ``guards``, ``algorithms``, ``settings``, ``rollout``,
``distributed``, ``accel`` and ``tasks``; never ``runs``."""
