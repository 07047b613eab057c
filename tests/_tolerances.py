"""Tolerances for comparing two float32 computations of the same numbers, derived from what can
differ between them, so that a comparison holds on any CPU's kernels (AVX-512, AVX2 or none).

Two rules cover the trainer-level comparisons:

1. **The same sums in another order.** Paths that are equal in exact arithmetic (log-softmax
   blocks, token-budget micro-batches, a fused LM head, compiled layers, two processes'
   all-reduce) add the same float32 terms in another order. Reordering a sum of n terms moves it
   by at most 2 n u sum|x_i| (u = 2**-24, float32's unit roundoff). When the terms have mixed
   signs, sum|x_i| exceeds |sum x_i| by the sum's condition number kappa; for n terms of random
   sign it is about sqrt(n), which :func:`reordered` takes.
2. **Adam after that.** Adam divides each coordinate's step by that coordinate's own gradient
   scale, so a rounding-level change in a near-zero gradient can change the coordinate's step by up
   to the whole step. Whatever the gradients, one step moves a coordinate by at most
   lr R_t, with R_t = sqrt(sum_s a_s^2 / b_s) over the bias-corrected moment weights a_s, b_s
   (Cauchy-Schwarz): 1 at t = 1 and 1.016 at t = 6 for betas (0.9, 0.999). So two runs' weights
   after k steps differ by at most :func:`adam_drift` in any one coordinate, however close their
   gradients were: weights after Adam steps can only be compared to that bound, or norm-wise.
   Comparisons that must be tight therefore start every step from the same weights (see
   ``_trainers.assert_same_steps``) and compare each step's metrics and gradients by rule 1.
"""

import math

U32 = 2.0**-24  # float32's unit roundoff


def reordered(terms: int) -> float:
    """Rule 1: the relative difference two float32 evaluations of a sum of ``terms`` terms of mixed
    sign can show when they add in other orders: 2 n u sqrt(n)."""
    return 2 * terms * U32 * math.sqrt(terms)


def adam_steps_bound(step: int, betas: tuple[float, float] = (0.9, 0.999)) -> float:
    """Rule 2: R_t, the largest |m_hat| / sqrt(v_hat) that Adam's ``step``-th step (from 1) can take
    in a coordinate, over every gradient history."""
    beta1, beta2 = betas
    first = [(1 - beta1) * beta1 ** (step - s) / (1 - beta1**step) for s in range(1, step + 1)]
    second = [(1 - beta2) * beta2 ** (step - s) / (1 - beta2**step) for s in range(1, step + 1)]
    return math.sqrt(sum(a * a / b for a, b in zip(first, second)))


def adam_drift(lr: float, steps: int, betas: tuple[float, float] = (0.9, 0.999)) -> float:
    """Rule 2: the most two runs of ``steps`` Adam steps at learning rate ``lr`` from the same
    weights can differ in one coordinate: 2 lr sum_t R_t."""
    return 2 * lr * sum(adam_steps_bound(t, betas) for t in range(1, steps + 1))
