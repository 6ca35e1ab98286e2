"""TOPR's successors whose authors publish their loss as part of a verl fork, restated as plain functions
with the same math in the same order of operations (neither fork can be installed beside verl 0.9.1;
both call verl's own `agg_loss`, which the functions below call too):

- `bapo.loss`: `compute_policy_loss_bapo` and `_compute_effective_advantage` in WooooDyy/BAPO
  `recipe/bapo/policy_loss.py` (the version that reads the bounds as ratio values; one process, so its
  all-reduce of the two sums does nothing): the search for the clip window (the lower bound raised
  first, then the upper, each loop stopping once `P / (N + eps)` reaches the target), then PPO-clip with
  that window and the dual clip `clip_ratio_c` for negative advantages.
- `ctpo.loss`: `_compute_policy_loss_cum_token_impl` (`cum-token-cumprod`, `cum-token-geomean`) and
  `_compute_policy_loss_cum_token_la_impl` (the `-la` modes) in horizon-llm/CTPO
  `verl/trainer/ppo/core_algos.py`: the prefix log-ratio (a sum, or a mean over the prefix), its
  stop-gradient decomposition, the cap at 10, PPO-clip with the actor's window or the position-scaled
  log-space window, and the dual clip. CTPO-LA's `la_power = 0` branch hands a Python float to
  `torch.exp` and cannot run; it is not restated.

Advantages go in per token (`[B, T]`), as verl takes them; the mask is a 0/1 nested list.
"""
import torch

from peers import leaf, out, peer, tensor


def _agg(loss_mat, mask, mode):
    from verl.trainer.ppo.core_algos import agg_loss

    return agg_loss(loss_mat=loss_mat, loss_mask=mask, loss_agg_mode=mode)


def _masked_mean(values, mask):
    import verl.utils.torch_functional as verl_F

    return verl_F.masked_mean(values, mask)


@peer("bapo.loss")
def bapo_loss(
    logp,
    logp_old,
    advantages,
    mask,
    lower_start,
    lower_max,
    lower_step,
    upper_start,
    upper_max,
    upper_step,
    target,
    eps,
    clip_ratio_c,
    loss_agg_mode,
):
    lp = leaf(logp)
    old = tensor(logp_old)
    adv = tensor(advantages)
    m = tensor(mask)

    log_ratio = torch.clamp(lp - old, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)

    def balance(low, high):
        # `_compute_effective_advantage`: the ratio clipped on the side the advantage's sign selects,
        # times the advantage and the mask; the positive and the negative parts summed.
        kept_high = torch.minimum(ratio, ratio.new_tensor(float(high)))
        kept_low = torch.maximum(ratio, ratio.new_tensor(float(low)))
        effective = torch.where(adv >= 0, kept_high, kept_low) * adv * m
        positive = effective.clamp(min=0).sum()
        negative = (-effective.clamp(max=0)).sum()
        if torch.all(negative <= 0):
            return ratio.new_tensor(float("inf")), positive, negative
        return positive / (negative + ratio.new_tensor(eps)), positive, negative

    low, high = lower_start, upper_start
    low_step, high_step = max(lower_step, 0.0), max(upper_step, 0.0)
    goal = max(target, 0.0)
    q, p_sum, n_sum = balance(low, high)
    steps = 0
    # The lower bound first ...
    while q.item() < goal and low < lower_max and low_step > 0:
        low = min(low + low_step, lower_max)
        steps += 1
        q, p_sum, n_sum = balance(low, high)
        if q.item() >= goal:
            break
    # ... then, if the target is still not met, the upper one.
    while q.item() < goal and high < upper_max and high_step > 0:
        high = min(high + high_step, upper_max)
        steps += 1
        q, p_sum, n_sum = balance(low, high)
        if q.item() >= goal:
            break

    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, low, high)
    first = torch.maximum(unclipped, clipped)
    clip_fraction = _masked_mean(torch.gt(clipped, unclipped).float(), m)
    capped = -adv * clip_ratio_c
    second = torch.min(capped, first)
    dual_fraction = _masked_mean(torch.gt(first, capped) * (adv < 0).float(), m)
    per_token = torch.where(adv < 0, second, first)
    loss = _agg(per_token, m, loss_agg_mode)
    loss.backward()
    return out(
        value=loss,
        grad=lp.grad,
        c_low=low,
        c_high=high,
        balance=q.item(),
        positive=p_sum.item(),
        negative=n_sum.item(),
        steps=steps,
        clip_fraction=clip_fraction,
        dual_clip_fraction=dual_fraction,
    )


@peer("ctpo.loss")
def ctpo_loss(
    logp,
    logp_old,
    advantages,
    mask,
    ratio_mode,
    length_adaptive,
    clip_low,
    clip_high,
    clip_ratio_c,
    la_clip_low,
    la_clip_high,
    la_clip_c,
    la_power,
    loss_agg_mode,
):
    lp = leaf(logp)
    old = tensor(logp_old)
    adv = tensor(advantages)
    response_mask = tensor(mask)

    token_log_ratio = torch.clamp(lp - old, min=-20.0, max=20.0)
    m = response_mask.to(dtype=token_log_ratio.dtype)
    prefix_sum = torch.cumsum(token_log_ratio * m, dim=-1)
    if ratio_mode == "geomean":
        count = torch.cumsum(m, dim=-1).clamp(min=1.0)
        prefix = torch.where(m > 0, prefix_sum / count, torch.zeros_like(prefix_sum))
    elif ratio_mode == "cumprod":
        prefix = torch.where(m > 0, prefix_sum, torch.zeros_like(prefix_sum))
    else:
        raise ValueError(ratio_mode)
    # The prefix's value, the gradient of token t alone; capped at 10 in log space.
    log_weight = prefix.detach() + lp - lp.detach()
    log_weight = torch.clamp(log_weight, max=10.0)
    weight = torch.where(m > 0, torch.exp(log_weight), torch.zeros_like(log_weight))

    if length_adaptive:
        position = torch.cumsum(m, dim=-1)
        scale = position.clamp(min=1.0).pow(la_power)
        bound_low = la_clip_low * scale
        bound_high = la_clip_high * scale
        bound_c = la_clip_c * scale
        clipped_log = torch.clamp(log_weight, -bound_low, bound_high)
        clipped_weight = torch.where(m > 0, torch.exp(clipped_log), torch.zeros_like(clipped_log))
        threshold = torch.where(m > 0, torch.exp(bound_c), torch.ones_like(bound_c))
    else:
        clipped_weight = torch.clamp(weight, 1 - clip_low, 1 + clip_high)
        threshold = clip_ratio_c

    unclipped = -adv * weight
    clipped = -adv * clipped_weight
    first = torch.maximum(unclipped, clipped)
    clip_fraction = _masked_mean(torch.gt(clipped, unclipped).float(), response_mask)
    capped = -adv * threshold
    second = torch.min(capped, first)
    dual_fraction = _masked_mean(torch.gt(first, capped) * (adv < 0).float(), response_mask)
    per_token = torch.where(adv < 0, second, first)
    loss = _agg(per_token, response_mask, loss_agg_mode)
    loss.backward()
    return out(
        value=loss,
        grad=lp.grad,
        weight=weight,
        clip_fraction=clip_fraction,
        dual_clip_fraction=dual_fraction,
    )
