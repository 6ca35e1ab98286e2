"""CHORD (arXiv 2508.11408) as Trinity-RFT writes it, restated as plain functions with the same math
in the same order of operations (Trinity-RFT is not installed: it pulls in its whole trainer).

Follows `trinity/algorithm/policy_loss_fn/chord_policy_loss.py` of modelscope/Trinity-RFT (the
version read at commit 04143305): `mu_schedule_function`, `phi_function`, `SFTPhiLossFn`
("sft_phi", with `cutoff_prob`), `SFTISLossFn` ("sft_is"), and `MIXCHORDPolicyLossFn` ("mix_chord"),
which combines `ppo_policy_loss.py::PPOPolicyLossFn` (clip range, dual clip `clip_ratio_c = 3`, the
log-ratio clamped to +-20, token-mean) on the usual rows with the SFT loss on the expert rows;
`sft_loss.py::SFTLossFn` ("sft") for `enable_phi_function=False`; and `trinity/algorithm/utils.py`'s
`masked_mean`, which adds 1e-8 to the count. One process, no dynamic batch size: each type's loss is
scaled by `n_type * gradient_accumulation / train_batch_size_type`.
"""
import math

import torch

from peers import leaf, out, peer, tensor


def _masked_mean(values, mask, axis=None):
    return (values * mask).sum(axis=axis) / (mask.sum(axis=axis) + 1e-8)


def _mu(step, warmup, decay, peak, valley):
    if step < warmup:
        return (step / warmup) * peak
    if step >= (warmup + decay):
        return valley
    cosine = 0.5 * (1 + math.cos(math.pi * (step - warmup) / decay))
    return (peak - valley) * cosine + valley


def _reduce(per_token, mask, token_level):
    if token_level:
        return _masked_mean(per_token, mask)
    return _masked_mean(per_token, mask, axis=1).mean()


def _sft(lp, mask, weight, cutoff_prob, token_level):
    """The three SFT losses: weight "uniform" (`SFTLossFn`), "phi" (`SFTPhiLossFn`), "probability"
    (`SFTISLossFn`); the cutoff as `SFTPhiLossFn` applies it."""
    prob = torch.exp(lp)
    target = lp
    if cutoff_prob < 1.0:
        target = torch.clamp(lp, max=math.log(cutoff_prob))
    if weight == "uniform":
        per_token = -target
    elif weight == "phi":
        per_token = -target * (prob * (1 - prob)).detach()
    else:
        per_token = -target * prob.detach()
    return _reduce(per_token, mask, token_level)


def _ppo(lp, lp_old, mask, adv, clip, clip_ratio_c=3.0):
    log_ratio = torch.clamp(lp - lp_old, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    losses1 = -adv * ratio
    losses2 = -adv * torch.clamp(ratio, 1.0 - clip, 1.0 + clip)
    clipped = torch.maximum(losses1, losses2)
    dual = torch.min(-adv * clip_ratio_c, clipped)
    return _masked_mean(torch.where(adv < 0, dual, clipped), mask)


@peer("trinity.mu_schedule")
def mu_schedule(steps, warmup, decay, peak, valley):
    return out(values=[_mu(s, warmup, decay, peak, valley) for s in steps])


@peer("trinity.sft")
def sft(logp, mask, weight, cutoff_prob, token_level):
    lp = leaf(logp)
    loss = _sft(lp, tensor(mask), weight, cutoff_prob, token_level)
    loss.backward()
    return out(value=loss, grad=lp.grad)


@peer("trinity.mix_chord")
def mix_chord(logp, logp_old, mask, advantages, expert, step, warmup, decay, peak, valley, enable_phi, clip,
              gradient_accumulation, train_batch_size_usual, train_batch_size_expert):
    lp = leaf(logp)
    m = tensor(mask)
    old = tensor(logp_old)
    adv = tensor(advantages)[:, None].expand_as(lp)
    expert_mask = torch.tensor(expert, dtype=torch.bool)
    n_usual = torch.sum(~expert_mask).item()
    n_expert = torch.sum(expert_mask).item()
    w_usual = gradient_accumulation / train_batch_size_usual
    w_expert = gradient_accumulation / train_batch_size_expert
    if n_usual > 0:
        rl = _ppo(lp[~expert_mask], old[~expert_mask], m[~expert_mask], adv[~expert_mask], clip)
        rl = rl * n_usual * w_usual
    else:
        rl = torch.tensor(0.0, dtype=torch.float64)
    if n_expert > 0:
        sft_loss = _sft(lp[expert_mask], m[expert_mask], "phi" if enable_phi else "uniform", 1.0, True)
        sft_loss = sft_loss * n_expert * w_expert
    else:
        sft_loss = torch.tensor(0.0, dtype=torch.float64)
    mu = _mu(step, warmup, decay, peak, valley)
    loss = (1 - mu) * rl + mu * sft_loss
    loss.backward()
    return out(value=loss, grad=lp.grad, mu=mu)
