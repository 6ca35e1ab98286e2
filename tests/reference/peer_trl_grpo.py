"""TRL 1.16.0's GRPO advantage scaling and importance-corrected KL, restated as plain functions.

TRL writes these inline in `GRPOTrainer` methods (`trl/trainer/grpo_trainer.py`), so they are restated
here in our own words, with the same math in the same order of operations:
- `trl.batch_std_advantage`: `_generate_and_score_completions`, lines 2760-2790 of TRL 1.16.0
  (`multi_objective_aggregation="sum_then_normalize"`, `scale_rewards="batch"`, one reward function).
- `trl.corrected_kl`: `_compute_loss`, lines 3083-3102 (and 3150, where `beta` multiplies it) of TRL 1.16.0 (`importance_sampling_level="token"`,
  `beta != 0`, `use_bias_correction_kl=True`).
"""
import torch

from peers import leaf, out, peer, tensor


def _unbiased_std(x):
    """Standard deviation with Bessel's correction (TRL's `nanstd` on a tensor without NaN)."""
    mean = x.mean()
    var = ((x - mean) ** 2).mean()
    n = x.numel()
    return (var * (n / (n - 1))).sqrt()


@peer("trl.batch_std_advantage")
def batch_std_advantage(rewards, num_generations):
    """Group mean, standard deviation of the whole batch, eps 1e-4; `rewards` flat, grouped by rows of
    `num_generations`."""
    r = tensor(rewards)
    group_mean = r.view(-1, num_generations).mean(dim=1).repeat_interleave(num_generations, dim=0)
    std = _unbiased_std(r).expand_as(r) if r.numel() > 1 else torch.zeros_like(r)
    return out(advantages=(r - group_mean) / (std + 1e-4))


@peer("trl.corrected_kl")
def corrected_kl(logp, logp_mu, logp_ref, mask):
    """Per-token k3 of (logp, logp_ref) times the non-detached ratio exp(logp - logp_mu); the
    token-mean over `mask` (what `beta` multiplies under TRL's token-level losses) and its gradient."""
    lp = leaf(logp)
    ref = tensor(logp_ref)
    m = tensor(mask)
    per_token_kl = torch.exp(ref - lp) - (ref - lp) - 1
    coef_1 = torch.exp(lp - tensor(logp_mu))
    per_token_kl = per_token_kl * coef_1
    loss = (per_token_kl * m).sum() / m.sum()
    loss.backward()
    return out(value=loss, grad=lp.grad, per_token=per_token_kl)
