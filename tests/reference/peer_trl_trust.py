"""Trust-region and sequence-weighting lines that TRL 1.16.0, prime-rl and SkyRL 0.4.0 write inline in
their trainers, restated as plain functions with the same math in the same order of operations (none
of the three can be imported without its trainer's dependencies):
- `trl.vespo`: `GRPOTrainer.get_gamma_weights` (trl/trainer/grpo_trainer.py, lines 2972-3018 of TRL
  1.16.0) and `_compute_loss` for `loss_type="vespo"`, no vLLM importance weights, one process, no
  gradient accumulation (the loss is then the token mean over the mask).
- `trl.delta_clip`: `_compute_loss` lines 3112-3119 (`delta` set, `importance_sampling_level="token"`,
  `loss_type="dapo"`: a token mean).
- `trl.luspo`: the same lines at `importance_sampling_level="sequence"` with `loss_type="luspo"`'s
  reduction, lines 3175-3182 (`(per_token_loss * mask).sum(-1).mean()`).
- `prime_rl.default_loss`: `default_loss_fn` in prime-rl's `src/prime_rl/trainer/rl/loss.py` (the
  DPPO-TV mask on the probability difference, conditioned on the advantage's sign, plus
  `kl_tau * (log π − log μ)²`), one sample, divided by its token count.
- `skyrl.cispo`: `compute_policy_loss_cispo` in SkyRL 0.4.0's `ppo_utils.py` (`cispo_eps_clip_low`,
  `cispo_eps_clip_high`; the anchor is whichever log-probs are passed), with `token_mean` reduction.
"""
import math

import torch

from peers import leaf, out, peer, tensor


@peer("trl.vespo")
def vespo(logp, logp_old, advantages, mask, k_pos, lambda_pos, k_neg, lambda_neg):
    lp = leaf(logp)
    m = tensor(mask)
    adv = tensor(advantages)[:, None]
    with torch.no_grad():
        log_ratio = lp.detach() - tensor(logp_old)
        lo = math.log(1e-8)
        s = (torch.clamp(log_ratio, -20.0, 20.0) * m).sum(dim=-1, keepdim=True)
        log_w = torch.clamp(s, lo, 20.0)
        w = torch.exp(log_w)
        k = torch.where(adv >= 0, torch.full_like(adv, k_pos), torch.full_like(adv, k_neg))
        lam = torch.where(adv >= 0, torch.full_like(adv, lambda_pos), torch.full_like(adv, lambda_neg))
        lam = torch.clamp(lam, min=1e-4)
        phi = torch.exp(lam + k * log_w - lam * w)
        phi = torch.nan_to_num(phi, nan=0.0, posinf=0.0, neginf=0.0)
    per_token = -phi * adv * lp
    loss = (per_token * m).sum() / m.sum().clamp(min=1.0)
    loss.backward()
    return out(value=loss, grad=lp.grad, phi=phi[:, 0])


@peer("trl.delta_clip")
def delta_clip(logp, logp_old, advantages, mask, eps_low, eps_high, delta):
    lp = leaf(logp)
    m = tensor(mask)
    adv = tensor(advantages)[:, None]
    coef_1 = torch.exp(lp - tensor(logp_old))
    coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
    coef_1 = torch.clamp(coef_1, max=delta)
    per_token = -torch.min(coef_1 * adv, coef_2 * adv)
    loss = (per_token * m).sum() / m.sum().clamp(min=1.0)
    loss.backward()
    return out(value=loss, grad=lp.grad)


@peer("trl.luspo")
def luspo(logp, logp_old, advantages, mask, eps_low, eps_high):
    lp = leaf(logp)
    m = tensor(mask)
    adv = tensor(advantages)[:, None]
    log_ratio = lp - tensor(logp_old)
    seq = ((log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(seq)
    coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
    per_token = -torch.min(coef_1 * adv, coef_2 * adv)
    loss = (per_token * m).sum(-1).mean()
    loss.backward()
    return out(value=loss, grad=lp.grad)


@peer("prime_rl.default_loss")
def prime_rl_default_loss(logp, logp_mu, advantages, mask, mask_low, mask_high, kl_tau, adv_tau):
    lp = leaf(logp)
    lq = tensor(logp_mu)
    m = tensor(mask).bool()
    adv = tensor(advantages)[:, None].expand_as(lp)
    log_ratio = lp - lq
    ratio = torch.exp(log_ratio)
    with torch.no_grad():
        diff = torch.exp(lp) - torch.exp(lq)
        invalid = torch.where(adv > 0, diff > mask_high, diff < -mask_low)
    keep = m & ~invalid
    pg = keep * (adv_tau * adv) * ratio
    kl = m * log_ratio ** 2
    loss = (-pg + kl_tau * kl).sum() / m.sum()
    loss.backward()
    return out(value=loss, grad=lp.grad)


@peer("skyrl.cispo")
def skyrl_cispo(logp, logp_anchor, advantages, mask, eps_low, eps_high):
    lp = leaf(logp)
    m = tensor(mask)
    adv = tensor(advantages)[:, None] / m.sum()  # token_mean folded into the advantages
    ratio = torch.exp(torch.clamp(lp - tensor(logp_anchor), -20.0, 20.0))
    clamped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
    loss = (-adv * clamped.detach() * lp * m).sum()
    loss.backward()
    return out(value=loss, grad=lp.grad)
