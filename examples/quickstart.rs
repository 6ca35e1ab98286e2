//! Quickstart: one fixed off-policy data set, five members of the off-policy REINFORCE family.
//!
//! A small autoregressive policy writes sequences of `L = 6` tokens from a vocabulary of 4. A
//! sequence is correct (reward +1) when at least 3 of its tokens are token 0, else wrong (−1).
//! A fixed behaviour policy μ samples a data set of `N = 256` sequences once; each preset then
//! trains a fresh copy of the policy, starting at μ, on that same data for 300 full-batch Adam
//! steps. Because the space holds only 4^6 = 4096 sequences, the expected reward E_π[R] and the
//! probability mass π puts on the data set are computed exactly, not estimated.
//!
//! Run: `cargo run --release --example quickstart` (after `source scripts/env.sh`).

use std::time::Instant;
use tch::nn::{self, OptimizerConfig};
use tch::{Device, IndexOp, Kind, Tensor};
use topr_loss::{Normalizer, ToprConfig, topr_loss_output};

const L: i64 = 6; // sequence length
const V: i64 = 4; // vocabulary
const N: i64 = 256; // data set size
const STEPS: i64 = 300;
const LR: f64 = 0.05;
const REPORT: [i64; 6] = [0, 25, 50, 100, 200, 300];

/// log π(y) for sequences `ys [M, L]` under logits `theta [L, V+1, V]`: the distribution of
/// token t depends on token t−1 (row V stands for "beginning of sequence").
fn log_prob(theta: &Tensor, ys: &Tensor) -> Tensor {
    let m = ys.size()[0];
    let lsm = theta.log_softmax(-1, Kind::Float).flatten(0, -1); // [L·(V+1)·V]
    let bos = Tensor::full([m, 1], V, (Kind::Int64, Device::Cpu));
    let prev = Tensor::cat(&[bos, ys.narrow(1, 0, L - 1)], 1); // [M, L]
    let t = Tensor::arange(L, (Kind::Int64, Device::Cpu)).unsqueeze(0); // [1, L]
    let idx = t * ((V + 1) * V) + prev * V + ys; // [M, L]
    lsm.take(&idx).sum_dim_intlist(1, false, Kind::Float) // [M]
}

/// Samples `n` sequences from the policy `theta`.
fn sample(theta: &Tensor, n: i64) -> Tensor {
    let probs = theta.softmax(-1, Kind::Float); // [L, V+1, V]
    let mut prev = Tensor::full([n], V, (Kind::Int64, Device::Cpu));
    let mut cols = vec![];
    for t in 0..L {
        let p = probs.i(t).index_select(0, &prev); // [n, V]
        let y = p.multinomial(1, true).squeeze_dim(1); // [n]
        cols.push(y.shallow_clone());
        prev = y;
    }
    Tensor::stack(&cols, 1) // [n, L]
}

/// +1 when at least 3 tokens are token 0, else −1.
fn reward(ys: &Tensor) -> Tensor {
    let zeros = ys.eq(0).sum_dim_intlist(1, false, Kind::Int64);
    zeros.ge(3).to_kind(Kind::Float) * 2.0 - 1.0
}

/// All 4^L sequences, [4096, L].
fn all_sequences() -> Tensor {
    let codes = Tensor::arange(V.pow(L as u32), (Kind::Int64, Device::Cpu)).unsqueeze(1);
    let powers = Tensor::from_slice(&(0..L).map(|t| V.pow((L - 1 - t) as u32)).collect::<Vec<_>>()).unsqueeze(0);
    codes.floor_divide(&powers).remainder(V)
}

struct Row {
    step: i64,
    expected_reward: f64,
    p_correct: f64,
    mass_data_pos: f64,
    mass_data_neg: f64,
    weight_mean: f64,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    tch::manual_seed(0);
    let start = Instant::now();
    let everything = all_sequences();
    let everything_reward = reward(&everything);

    // The behaviour policy μ: random logits, fixed for the whole run.
    let theta_mu = Tensor::randn([L, V + 1, V], (Kind::Float, Device::Cpu)) * 0.5;
    let data = sample(&theta_mu, N); // [N, L], sampled once
    let rewards = reward(&data);
    let logp_mu = log_prob(&theta_mu, &data);
    let p_data = rewards.gt(0.0).to_kind(Kind::Float).mean(Kind::Float).double_value(&[]);

    // Unique data sequences, to measure the probability mass π puts on the data set.
    let (unique, _, _) = data.unique_dim(0, true, false, false);
    let unique_pos = reward(&unique).gt(0.0);

    let measure = |theta: &Tensor| -> (f64, f64, f64, f64) {
        let p_all = log_prob(theta, &everything).exp();
        let er = (&p_all * &everything_reward).sum(Kind::Float).double_value(&[]);
        let pc = (&p_all * everything_reward.gt(0.0)).sum(Kind::Float).double_value(&[]);
        let p_unique = log_prob(theta, &unique).exp();
        let pos = (&p_unique * &unique_pos).sum(Kind::Float).double_value(&[]);
        let neg = (&p_unique * unique_pos.logical_not()).sum(Kind::Float).double_value(&[]);
        (er, pc, pos, neg)
    };
    let (er_mu, _, _, _) = measure(&theta_mu);
    println!(
        "data: {N} sequences sampled once from μ, {:.1}% correct; E_μ[R] = {er_mu:+.3} (best possible +1.000)",
        100.0 * p_data
    );
    println!("each preset: {STEPS} full-batch Adam steps (lr {LR}) on that data, starting from π = μ\n");

    let presets = [
        ("TOPR (canonical)", ToprConfig::canonical()),
        ("naive REINFORCE", ToprConfig::naive_reinforce()),
        ("SFT (positives)", ToprConfig::sft()),
        ("TIS", ToprConfig::tis()),
        ("IS", ToprConfig::importance_sampling()),
    ];
    let mut summary = vec![];
    for (name, cfg) in presets {
        let vs = nn::VarStore::new(Device::Cpu);
        let theta = vs.root().var_copy("theta", &theta_mu);
        let mut opt = nn::Adam::default().build(&vs, LR)?;
        let mut rows: Vec<Row> = vec![];
        let mut stopped = None;
        for step in 0..=STEPS {
            let logp = log_prob(&theta, &data);
            // The loss and its diagnostics come from one pass; reading the diagnostics is the
            // only host read, done only at the reported steps.
            let out = topr_loss_output(&logp, &logp_mu, &rewards, &cfg, &Normalizer::local());
            if REPORT.contains(&step) {
                let (expected_reward, p_correct, mass_data_pos, mass_data_neg) = tch::no_grad(|| measure(&theta));
                let weight_mean = match &out {
                    Ok(out) => out.diagnostics.read()?.weight_mean,
                    Err(_) => f64::NAN,
                };
                rows.push(Row { step, expected_reward, p_correct, mass_data_pos, mass_data_neg, weight_mean });
            }
            if step == STEPS {
                break;
            }
            match out {
                Ok(out) => opt.backward_step(&out.loss),
                Err(e) => {
                    stopped = Some(format!("stopped at step {step}: {e}"));
                    break;
                }
            }
        }
        println!("{name}  (a+, b+, a−, b−) = ({}, {}, {}, {})", cfg.a_pos, cfg.b_pos, cfg.a_neg, cfg.b_neg);
        println!("  step   E_π[R]   P_π(correct)   π-mass on data: correct  wrong   mean weight");
        for r in &rows {
            println!(
                "  {:>4}   {:+.3}   {:>12.3}   {:>23.3}  {:>6.3}   {:>11.3}",
                r.step, r.expected_reward, r.p_correct, r.mass_data_pos, r.mass_data_neg, r.weight_mean
            );
        }
        if let Some(s) = &stopped {
            println!("  {s}");
        }
        println!();
        if let Some(last) = rows.last() {
            summary.push((name, last.expected_reward, last.mass_data_pos + last.mass_data_neg));
        }
    }
    println!("final E_π[R] by preset:");
    for (name, er, mass) in summary {
        println!("  {name:<18} {er:+.3}   (π-mass on the data set {mass:.3})");
    }
    println!("\ntotal time {:.1} s", start.elapsed().as_secs_f64());
    Ok(())
}
