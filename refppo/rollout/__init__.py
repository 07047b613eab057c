"""A step's model passes: prompts to token ids and the batch layout (``prompts``), loading and
preparing the models (``models``), sampling (``generation``), the forward passes that give
log-probs, values and scores (``forward``) and the device's precision (``device``).

They may import the core, ``guards`` and ``settings``; ``accel`` plugs into them."""
