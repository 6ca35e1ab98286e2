"""verl 0.9.1's advantage estimators and value loss (`verl.trainer.ppo.core_algos`), on the tests' inputs.

Each function takes per-token inputs as nested lists (float64) and a `mask` of 0/1, calls verl's own
function and returns its outputs as lists. Groups are given as `index`, one prompt id per row, as verl
takes them.
"""
from types import SimpleNamespace

import numpy as np

from peers import leaf, out, peer, tensor


def _index(index):
    return np.array(index, dtype=object)


@peer("verl.grpo_advantage")
def grpo_advantage(token_rewards, mask, index, epsilon, norm_by_std):
    """`compute_grpo_outcome_advantage` (its `norm_adv_by_std_in_grpo`; a group of one: mean 0, std 1)."""
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    adv, _ = compute_grpo_outcome_advantage(
        tensor(token_rewards), tensor(mask), _index(index), epsilon=epsilon, norm_adv_by_std_in_grpo=norm_by_std
    )
    return out(advantages=adv)


@peer("verl.rloo_advantage")
def rloo_advantage(token_rewards, mask, index):
    """`compute_rloo_outcome_advantage`."""
    from verl.trainer.ppo.core_algos import compute_rloo_outcome_advantage

    adv, _ = compute_rloo_outcome_advantage(tensor(token_rewards), tensor(mask), _index(index))
    return out(advantages=adv)


@peer("verl.opo_advantage")
def opo_advantage(token_rewards, mask, index):
    """`compute_opo_outcome_advantage` (lengths: the mask's row sums)."""
    from verl.trainer.ppo.core_algos import compute_opo_outcome_advantage

    adv, _ = compute_opo_outcome_advantage(tensor(token_rewards), tensor(mask), _index(index))
    return out(advantages=adv)


@peer("verl.reinforce_pp_advantage")
def reinforce_pp_advantage(token_rewards, mask, gamma):
    """`compute_reinforce_plus_plus_outcome_advantage` with `config.gamma`."""
    from verl.trainer.ppo.core_algos import compute_reinforce_plus_plus_outcome_advantage

    adv, ret = compute_reinforce_plus_plus_outcome_advantage(
        tensor(token_rewards), tensor(mask), config=SimpleNamespace(gamma=gamma)
    )
    return out(advantages=adv, returns=ret)


@peer("verl.reinforce_pp_baseline_advantage")
def reinforce_pp_baseline_advantage(token_rewards, mask, index):
    """`compute_reinforce_plus_plus_baseline_outcome_advantage`."""
    from verl.trainer.ppo.core_algos import compute_reinforce_plus_plus_baseline_outcome_advantage

    adv, _ = compute_reinforce_plus_plus_baseline_outcome_advantage(tensor(token_rewards), tensor(mask), _index(index))
    return out(advantages=adv)


@peer("verl.remax_advantage")
def remax_advantage(token_rewards, greedy_rewards, mask):
    """`compute_remax_outcome_advantage` (`reward_baselines`: the greedy completions' rewards)."""
    from verl.trainer.ppo.core_algos import compute_remax_outcome_advantage

    adv, ret = compute_remax_outcome_advantage(tensor(token_rewards), tensor(greedy_rewards), tensor(mask))
    return out(advantages=adv, returns=ret)


@peer("verl.gae")
def gae(token_rewards, values, mask, gamma, lam):
    """`compute_gae_advantage_return` (advantages whitened by verl, returns not)."""
    from verl.trainer.ppo.core_algos import compute_gae_advantage_return

    adv, ret = compute_gae_advantage_return(tensor(token_rewards), tensor(values), tensor(mask), gamma, lam)
    return out(advantages=adv, returns=ret)


@peer("verl.value_loss")
def value_loss(values, values_old, returns, mask, clip, agg):
    """`compute_value_loss(vpreds, returns, values, mask, cliprange_value, loss_agg_mode)`, value, clip
    fraction and the gradient w.r.t. `vpreds`."""
    from verl.trainer.ppo.core_algos import compute_value_loss

    v = leaf(values)
    loss, clipfrac = compute_value_loss(v, tensor(returns), tensor(values_old), tensor(mask), clip, loss_agg_mode=agg)
    loss.backward()
    return out(value=loss, grad=v.grad, clip_fraction=clipfrac)


@peer("verl.passk_advantage")
def passk_advantage(token_rewards, mask, index, epsilon, norm_by_std):
    """`compute_grpo_passk_outcome_advantage` (`norm_adv_by_std_in_grpo` read from its config)."""
    from verl.trainer.ppo.core_algos import compute_grpo_passk_outcome_advantage

    adv, _ = compute_grpo_passk_outcome_advantage(
        tensor(token_rewards),
        tensor(mask),
        _index(index),
        epsilon=epsilon,
        config={"norm_adv_by_std_in_grpo": norm_by_std},
    )
    return out(advantages=adv)


@peer("verl.gdpo_advantage")
def gdpo_advantage(scores, weights, mask, index, epsilon, norm_by_std):
    """`compute_gdpo_outcome_advantage` with one reward key per dimension (`scores[d]`, one value
    per row, which verl reads in float32 and places on each response's last token) and
    `gdpo_reward_weights`."""
    import torch
    from verl.trainer.ppo.core_algos import compute_gdpo_outcome_advantage

    m = tensor(mask)
    keys = [f"r{d}" for d in range(len(scores))]
    non_tensor = {key: np.array(s, dtype=np.float32) for key, s in zip(keys, scores)}
    ones = torch.ones(m.shape[0], 1, dtype=torch.int64)
    batch = {"prompts": torch.zeros_like(ones), "attention_mask": torch.cat([ones, m.to(torch.int64)], 1)}
    adv, _ = compute_gdpo_outcome_advantage(
        torch.zeros_like(m),
        m,
        _index(index),
        epsilon=epsilon,
        norm_adv_by_std_in_grpo=norm_by_std,
        config={"gdpo_reward_keys": keys, "gdpo_reward_weights": weights},
        non_tensor_batch=non_tensor,
        batch=batch,
    )
    return out(advantages=adv)


@peer("verl.optimal_token_baseline_advantage")
def optimal_token_baseline_advantage(
    token_rewards, mask, index, old_log_probs, sum_pi_squared, rollout_is_weights, handle_zero_tail, epsilon
):
    """`compute_optimal_token_baseline_advantage` (`algorithm.adv_estimator=optimal_token_baseline`),
    `rollout_is_weights` None or per token, returns both outputs (advantages, returns)."""
    from verl.trainer.ppo.core_algos import compute_optimal_token_baseline_advantage

    adv, ret = compute_optimal_token_baseline_advantage(
        tensor(token_rewards),
        tensor(mask),
        _index(index),
        tensor(old_log_probs),
        tensor(sum_pi_squared),
        rollout_is_weights=None if rollout_is_weights is None else tensor(rollout_is_weights),
        handle_zero_tail=handle_zero_tail,
        epsilon=epsilon,
    )
    return out(advantages=adv, returns=ret)
