"""verl 0.9.1's research policy losses (`verl.trainer.ppo.core_algos`): SAPO, GMPO (`geo_mean`), DPPO,
Clip-Cov and KL-Cov, value and gradient; and the entropy bonus as verl's actor adds it.

Each function builds the `ActorConfig` dataclass verl's loss reads (with a `PolicyLossConfig` for the
covariance losses) and calls verl's registered function itself on float64 inputs. Advantages go in
per token (`[B, T]`), as verl takes them; `mask` is a 0/1 nested list, passed as bool like verl's
actor does (`response_mask.to(bool)`).
"""
import torch

from peers import leaf, out, peer, tensor


def _config(**kw):
    from verl.workers.config.actor import ActorConfig, PolicyLossConfig

    policy_loss = kw.pop("policy_loss", {})
    return ActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=1,
        policy_loss=PolicyLossConfig(**policy_loss),
        **kw,
    )


def _run(fn, logp, logp_mu, advantages, mask, loss_agg_mode, config):
    lp = leaf(logp)
    loss, metrics = fn(
        old_log_prob=tensor(logp_mu),
        log_prob=lp,
        advantages=tensor(advantages),
        response_mask=tensor(mask, dtype=torch.bool),
        loss_agg_mode=loss_agg_mode,
        config=config,
    )
    loss.backward()
    return out(value=loss, grad=lp.grad, **{k.split("/")[-1]: v for k, v in metrics.items()})


@peer("verl.sapo")
def sapo(logp, logp_mu, advantages, mask, tau_pos, tau_neg):
    """`compute_policy_loss_sapo` (it aggregates with seq-mean-token-mean whatever the mode)."""
    from verl.trainer.ppo.core_algos import compute_policy_loss_sapo

    cfg = _config(tau_pos=tau_pos, tau_neg=tau_neg)
    return _run(compute_policy_loss_sapo, logp, logp_mu, advantages, mask, "token-mean", cfg)


@peer("verl.geo_mean")
def geo_mean(logp, logp_mu, advantages, mask, clip_low, clip_high):
    """`compute_policy_loss_geo_mean` with `clip_ratio_low/high` (it ignores `loss_agg_mode`)."""
    from verl.trainer.ppo.core_algos import compute_policy_loss_geo_mean

    cfg = _config(clip_ratio=clip_low, clip_ratio_low=clip_low, clip_ratio_high=clip_high)
    return _run(compute_policy_loss_geo_mean, logp, logp_mu, advantages, mask, "token-mean", cfg)


@peer("verl.clip_cov")
def clip_cov(logp, logp_mu, advantages, mask, clip_low, clip_high, ratio, lb, ub, loss_agg_mode, seed):
    """`compute_policy_loss_clip_cov` after `torch.manual_seed(seed)` (its `torch.randperm` draws
    from the global CPU generator)."""
    from verl.trainer.ppo.core_algos import compute_policy_loss_clip_cov

    cfg = _config(
        clip_ratio=clip_low,
        clip_ratio_low=clip_low,
        clip_ratio_high=clip_high,
        policy_loss=dict(clip_cov_ratio=ratio, clip_cov_lb=lb, clip_cov_ub=ub),
    )
    torch.manual_seed(seed)
    return _run(compute_policy_loss_clip_cov, logp, logp_mu, advantages, mask, loss_agg_mode, cfg)


@peer("verl.kl_cov")
def kl_cov(logp, logp_mu, advantages, mask, ratio, coef, loss_agg_mode):
    """`compute_policy_loss_kl_cov` with `kl_cov_ratio` and `ppo_kl_coef`."""
    from verl.trainer.ppo.core_algos import compute_policy_loss_kl_cov

    cfg = _config(policy_loss=dict(kl_cov_ratio=ratio, ppo_kl_coef=coef))
    return _run(compute_policy_loss_kl_cov, logp, logp_mu, advantages, mask, loss_agg_mode, cfg)


@peer("verl.entropy_bonus")
def entropy_bonus(entropy, mask, coef, loss_agg_mode):
    """The entropy term verl's actor subtracts from the policy loss (`workers/utils/losses.py`:
    `policy_loss -= entropy_coeff * agg_loss(entropy, response_mask, loss_agg_mode)`), as a term on
    its own: `-coef * agg_loss(...)`, calling verl's `agg_loss`."""
    from verl.trainer.ppo.core_algos import agg_loss

    h = leaf(entropy)
    term = -coef * agg_loss(loss_mat=h, loss_mask=tensor(mask, dtype=torch.bool), loss_agg_mode=loss_agg_mode)
    term.backward()
    return out(value=term, grad=h.grad)


@peer("verl.entropy_from_logits")
def entropy_from_logits(logits):
    """verl's `entropy_from_logits` (what `compute_entropy_loss` aggregates), per token."""
    from verl.utils.torch_functional import entropy_from_logits as ent

    return out(value=ent(tensor(logits)))


@peer("verl.dppo")
def dppo(logp, logp_mu, advantages, mask, divergence, clip_low, clip_high, clip_c, loss_agg_mode):
    """`compute_policy_loss_dppo_tv` or `compute_policy_loss_dppo_kl` (`divergence`: "tv" or "kl"),
    with `clip_ratio_low/high` as the trust region's bounds and `clip_ratio_c` as the truncation."""
    from verl.trainer.ppo.core_algos import compute_policy_loss_dppo_kl, compute_policy_loss_dppo_tv

    fn = compute_policy_loss_dppo_tv if divergence == "tv" else compute_policy_loss_dppo_kl
    cfg = _config(clip_ratio=clip_low, clip_ratio_low=clip_low, clip_ratio_high=clip_high, clip_ratio_c=clip_c)
    return _run(fn, logp, logp_mu, advantages, mask, loss_agg_mode, cfg)


@peer("verl.dro")
def dro(logp, logp_mu, advantages, mask, beta, loss_agg_mode):
    """`compute_policy_loss_dro` with `policy_loss.dro_beta`."""
    from verl.trainer.ppo.core_algos import compute_policy_loss_dro

    cfg = _config(policy_loss=dict(dro_beta=beta))
    return _run(compute_policy_loss_dro, logp, logp_mu, advantages, mask, loss_agg_mode, cfg)


@peer("verl.bypass_mode")
def bypass_mode(logp, logp_rollout, advantages, mask, loss_type, rollout_is, is_threshold, rs, rs_threshold,
                clip_low, clip_high, loss_agg_mode):
    """`compute_policy_loss_bypass_mode`: the rollout's log-probs as the old policy, with
    `rollout_correction` (`loss_type` "reinforce" or "ppo_clip", `rollout_is`, `rollout_rs`).

    verl hands the IS weights from its helper to the loss in a `DataProto`, whose check fails with
    the tensordict version installed beside verl here (`batch_size` of an empty TensorDict); the
    container is replaced by a plain holder of the same tensor, and everything verl computes (the
    weights, the rejection mask, the dispatch, the loss) is its own code."""
    from types import SimpleNamespace

    import verl.trainer.ppo.rollout_corr_helper as helper
    from verl.trainer.config.algorithm import RolloutCorrectionConfig
    from verl.trainer.ppo.core_algos import compute_policy_loss_bypass_mode

    class _Holder:
        @staticmethod
        def from_dict(tensors):
            return SimpleNamespace(batch=dict(tensors))

    helper.DataProto = _Holder

    rc = RolloutCorrectionConfig(
        rollout_is=rollout_is,
        rollout_is_threshold=is_threshold,
        rollout_rs=rs,
        rollout_rs_threshold=rs_threshold,
        bypass_mode=True,
        loss_type=loss_type,
    )
    cfg = _config(
        clip_ratio=clip_low, clip_ratio_low=clip_low, clip_ratio_high=clip_high, policy_loss=dict(rollout_correction=rc)
    )
    return _run(compute_policy_loss_bypass_mode, logp, logp_rollout, advantages, mask, loss_agg_mode, cfg)
