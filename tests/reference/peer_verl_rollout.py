"""verl 0.9.1's rollout correction (`verl.trainer.ppo.rollout_corr_helper`) and its use in the
policy losses (`rollout_is_weights` multiplying `pg_losses`), on a test's inputs."""
from peers import leaf, verl_actor_config, out, peer, tensor


@peer("verl.rollout_weights")
def rollout_weights(logp, logp_rollout, mask, level, threshold, batch_normalize=False):
    """`compute_rollout_correction_weights(old − rollout, mask, level, threshold, batch_normalize)`."""
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_weights

    lr = tensor(logp) - tensor(logp_rollout)
    w, m = compute_rollout_correction_weights(lr, tensor(mask), level, threshold, batch_normalize)
    return out(weights=w, ess=m["rollout_is_eff_sample_size"], mean=m["rollout_is_mean"])


@peer("verl.offpolicy_metrics")
def offpolicy_metrics(logp, logp_rollout, mask):
    """`compute_offpolicy_metrics`: the KL, k3 KL and token χ² verl logs."""
    from verl.trainer.ppo.rollout_corr_helper import compute_offpolicy_metrics

    m = compute_offpolicy_metrics(tensor(logp), tensor(logp_rollout), tensor(mask))
    return out(kl=m["kl"], k3_kl=m["k3_kl"], chi2=m["chi2_token"])


@peer("verl.rejection_mask")
def rejection_mask(logp, logp_rollout, mask, options, threshold):
    """`compute_rollout_rejection_mask(old − rollout, mask, options, threshold)`."""
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_rejection_mask

    lr = tensor(logp) - tensor(logp_rollout)
    kept, _ = compute_rollout_rejection_mask(lr, tensor(mask), options, threshold)
    return out(mask=kept)


@peer("verl.policy_loss_with_is")
def policy_loss_with_is(loss, logp, logp_old, advantages, mask, weights, agg, clip_low, clip_high):
    """verl's `compute_policy_loss_<loss>` ("vanilla": PPO with its always-on dual clip c = 3, or
    "gspo") with `rollout_is_weights`: value and gradient w.r.t. `logp`."""
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    lp = leaf(logp)
    cfg = verl_actor_config(clip_ratio_low=clip_low, clip_ratio_high=clip_high)
    adv = tensor(advantages)
    if adv.dim() == 1:
        adv = adv[:, None].expand(lp.shape)
    value, _ = get_policy_loss_fn(loss)(tensor(logp_old), lp, adv, tensor(mask), agg, cfg, tensor(weights))
    value.backward()
    return out(value=value, grad=lp.grad)
