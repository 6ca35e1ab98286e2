"""TRL 1.16.0's SAPO loss (`loss_type="sapo"`), restated as a function.

Follows `trl/trainer/grpo_trainer.py` of TRL 1.16.0, `GRPOTrainer._compute_loss`: lines 3057-3059
(advantages `[B]` become `[B, 1]`), 3083 and 3085-3095 (token-level log-ratio, `coef_1 = exp`, no
clamp), 3121-3124 (the temperatures chosen by `advantages > 0`, the gate, the per-token loss) and
3153-3154 (each sequence's masked token mean, then the mean over all rows), without the gradient
accumulation divisor and with no KL term (`beta = 0`).
"""
import torch

from peers import leaf, out, peer, tensor


@peer("trl.sapo")
def sapo(logp, logp_mu, advantages, mask, tau_pos, tau_neg):
    lp = leaf(logp)
    m = tensor(mask)
    adv = tensor(advantages)
    if adv.dim() == 1:
        adv = adv.unsqueeze(1)
    coef_1 = torch.exp(lp - tensor(logp_mu))
    temperatures = torch.where(adv > 0, tau_pos, tau_neg)
    soft_coef_1 = torch.sigmoid(temperatures * (coef_1 - 1)) * 4 / temperatures
    per_token_loss = -soft_coef_1 * adv
    loss = ((per_token_loss * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
    loss.backward()
    return out(value=loss, grad=lp.grad)
