"""TRL 1.16.0's DPO-family losses, restated as a plain function.

TRL writes these losses inline in `DPOTrainer._compute_loss` (trl/trainer/dpo_trainer.py of TRL
1.16.0, lines 1366-1525: the log-ratios, the `reverse_kl` f-divergence scores, and the loop over
`loss_type` / `loss_weights` that sums `loss_weight * per_sequence_loss.mean()`), so this module
restates those lines on sequence log-probs: the same formulas in the same order of operations.
Not restated: the other f-divergences, `ld_alpha`, `use_weighting` (WPO), the `sft` loss type and the
auxiliary router loss, which the crate's tests do not compare.

One deliberate difference: for `exo_pair` TRL builds ε with `torch.tensor(label_smoothing)`, a
float32 tensor under torch's default dtype, so with float64 log-probs its `log ε` and `log(1 - ε)`
carry float32 rounding (about 5e-8 relative). Here ε is a float64 tensor, so that the comparison
measures the formula, not that rounding.

`chosen_lens` / `rejected_lens` stand for the number of completion tokens (`completion_mask.sum(1)`),
used by `ipo` and `sigmoid_norm` to average the summed log-ratios (clamped to at least 1).
"""
import math

import torch
import torch.nn.functional as F

from peers import leaf, out, peer, tensor


@peer("trl.dpo_loss")
def dpo_loss(
    chosen_logps,
    rejected_logps,
    ref_chosen_logps,
    ref_rejected_logps,
    loss_type,
    beta=0.1,
    label_smoothing=0.0,
    discopop_tau=0.05,
    loss_weights=None,
    chosen_lens=None,
    rejected_lens=None,
):
    """The DPO loss of `loss_type` (a list), its value and its gradient w.r.t. the policy log-probs."""
    pc, pr = leaf(chosen_logps), leaf(rejected_logps)
    rc, rr = tensor(ref_chosen_logps), tensor(ref_rejected_logps)
    n = len(chosen_logps)
    clen = tensor(chosen_lens if chosen_lens is not None else [1.0] * n)
    rlen = tensor(rejected_lens if rejected_lens is not None else [1.0] * n)
    weights = loss_weights or [1.0] * len(loss_type)

    chosen_logratios = pc - rc
    rejected_logratios = pr - rr
    # f_divergence_type == "reverse_kl"
    chosen_scores = chosen_logratios
    rejected_scores = rejected_logratios
    delta_score = chosen_scores - rejected_scores

    loss = 0.0
    for kind, weight in zip(loss_type, weights, strict=True):
        if kind == "sigmoid":
            per_sequence_loss = -F.logsigmoid(beta * delta_score)
        elif kind == "hinge":
            per_sequence_loss = torch.relu(1 - beta * delta_score)
        elif kind == "ipo":
            ipo_delta = chosen_scores / clen.clamp(min=1.0) - rejected_scores / rlen.clamp(min=1.0)
            per_sequence_loss = (ipo_delta - 1 / (2 * beta)) ** 2
        elif kind == "exo_pair":
            epsilon = torch.tensor(label_smoothing, dtype=torch.float64)  # TRL: float32, see above
            qw = torch.sigmoid(beta * delta_score)
            log_qw = F.logsigmoid(beta * delta_score)
            log_pw = torch.log1p(-epsilon)
            ql = torch.sigmoid(-beta * delta_score)
            log_ql = F.logsigmoid(-beta * delta_score)
            log_pl = torch.log(epsilon)
            per_sequence_loss = qw * (log_qw - log_pw) + ql * (log_ql - log_pl)
        elif kind == "nca_pair":
            cr, rj = beta * chosen_logratios, beta * rejected_logratios
            per_sequence_loss = -F.logsigmoid(cr) - 0.5 * F.logsigmoid(-cr) - 0.5 * F.logsigmoid(-rj)
        elif kind == "robust":
            clean = -(1 - label_smoothing) * F.logsigmoid(beta * delta_score)
            flipped = -label_smoothing * F.logsigmoid(-beta * delta_score)
            per_sequence_loss = (clean - flipped) / (1 - 2 * label_smoothing)
        elif kind == "bco_pair":
            cr, rj = beta * chosen_logratios, beta * rejected_logratios
            per_sequence_loss = -F.logsigmoid(cr) - F.logsigmoid(-rj)
        elif kind == "sppo_hard":
            per_sequence_loss = (chosen_logratios - 0.5 / beta) ** 2 + (rejected_logratios + 0.5 / beta) ** 2
        elif kind in ("aot", "aot_unpaired"):
            if kind == "aot":
                a, _ = torch.sort(pc - pr, dim=0)
                b, _ = torch.sort(rc - rr, dim=0)
            else:
                a, _ = torch.sort(chosen_logratios, dim=0)
                b, _ = torch.sort(rejected_logratios, dim=0)
            delta = a - b
            per_sequence_loss = (
                -F.logsigmoid(beta * delta) * (1 - label_smoothing) - F.logsigmoid(-beta * delta) * label_smoothing
            )
        elif kind == "apo_zero":
            per_sequence_loss = (1 - torch.sigmoid(beta * chosen_logratios)) + torch.sigmoid(beta * rejected_logratios)
        elif kind == "apo_down":
            per_sequence_loss = torch.sigmoid(beta * chosen_logratios) + (
                1 - torch.sigmoid(beta * (chosen_logratios - rejected_logratios))
            )
        elif kind == "discopop":
            logits = delta_score * beta
            modulation = torch.sigmoid(logits / discopop_tau)
            per_sequence_loss = -F.logsigmoid(logits) * (1 - modulation) + torch.exp(-logits) * modulation
        elif kind == "sigmoid_norm":
            delta = chosen_scores / clen.clamp(min=1.0) - rejected_scores / rlen.clamp(min=1.0)
            per_sequence_loss = -F.logsigmoid(beta * delta)
        else:
            raise ValueError(f"peer_trl_dpo: loss type {kind!r} is not restated")
        loss = loss + per_sequence_loss.mean() * weight

    loss.backward()
    assert math.isfinite(loss.item())
    return out(value=loss, grad_chosen=pc.grad, grad_rejected=pr.grad)
