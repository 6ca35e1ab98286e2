"""Skywork-OR1's adaptive entropy coefficient (arXiv 2505.22312), restated as a plain function.

Follows `EntController` in `verl/trainer/ppo/core_algos.py` of SkyworkAI/Skywork-OR1 (read in the
pacresdarryl/Skywork-OR1 copy, commit 7bbe0886): the coefficient moves by `delta_ent_coef` up when
the measured entropy is below `target_ent` and down otherwise, is clipped with `np.clip` to
`[min_ent_coef, max_ent_coef]`, and `entropy_loss_enabled = int(current_ent < target_ent)`; it
starts at `init_ent_coef` with the bonus enabled. With `use_adapt_ent=False` nothing changes.
"""
import numpy as np

from peers import out, peer


class _EntController:
    def __init__(self, init, max_coef, min_coef, delta, target, adaptive):
        self.value = init
        self.max_value = max_coef
        self.min_value = min_coef
        self.delta = delta
        self.target = target
        self.adaptive = adaptive
        self.enabled = 1

    def update(self, current):
        if not self.adaptive:
            return
        if current < self.target:
            self.value += self.delta
        else:
            self.value -= self.delta
        self.value = float(np.clip(self.value, self.min_value, self.max_value))
        self.enabled = int(current < self.target)


@peer("skywork.ent_controller")
def ent_controller(init, target, delta, min_coef, max_coef, entropies, adaptive=True):
    """The coefficient and the enabled flag after each update, and the realised coefficient
    `value * enabled` (what `dp_actor.py` multiplies the entropy term by)."""
    c = _EntController(init, max_coef, min_coef, delta, target, adaptive)
    values, enabled, realised = [], [], []
    for e in entropies:
        c.update(e)
        values.append(c.value)
        enabled.append(c.enabled)
        realised.append(c.value * c.enabled)
    return out(values=values, enabled=enabled, realised=realised)
