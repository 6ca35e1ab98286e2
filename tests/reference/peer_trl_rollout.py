"""TRL 1.16.0's sampler-correction lines in `GRPOTrainer`, restated as functions.

- `importance_sampling_ratio`: trl/trainer/grpo_trainer.py lines 2659-2706
  (`vllm_importance_sampling_mode` with `vllm_importance_sampling_clip_min/max`).
- `off_policy_mask`: the static method `get_off_policy_mask`, lines 2944-2968 (DeepSeek-V3.2's
  off-policy sequence mask, `off_policy_mask_threshold`).
"""
import math

import torch

from peers import out, peer, tensor


@peer("trl.importance_sampling_ratio")
def importance_sampling_ratio(logp, logp_rollout, mask, mode, clip_min, clip_max):
    m = tensor(mask)
    diff = torch.nan_to_num((tensor(logp) - tensor(logp_rollout)) * m, nan=0.0)
    if mode in ("sequence_mask", "sequence_truncate"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode in ("sequence_truncate", "token_truncate"):
        ratio = torch.clamp(ratio, min=clip_min, max=clip_max)
    else:
        lo = clip_min if clip_min is not None else -math.inf
        hi = clip_max if clip_max is not None else math.inf
        ratio = ratio.masked_fill((ratio < lo) | (ratio > hi), 0.0)
    return out(weights=ratio.expand(m.shape) * m)


@peer("trl.off_policy_mask")
def off_policy_mask(logp, logp_rollout, advantages, mask, threshold):
    m = tensor(mask)
    kl = torch.nan_to_num(tensor(logp_rollout) - tensor(logp), nan=0.0)
    avg = (kl * m).sum(dim=1, keepdim=True) / m.sum(dim=1, keepdim=True).clamp(min=1.0)
    keep = (tensor(advantages)[:, None] >= 0) | (avg <= threshold)
    return out(mask=keep.to(m.dtype).expand(m.shape) * m)
