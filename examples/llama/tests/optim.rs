//! The Llama library's optimisers against their reference implementations: torch.optim.AdamW and
//! transformers' Adafactor, step by step on the same parameters and gradients; and the saved
//! state resumes a run exactly.

mod common;

use serde_json::json;
use std::collections::BTreeMap;
use tch::{Kind, Tensor};
use topr_llama::optim::{Optimizer, OptimizerConfig};

/// Deterministic pseudo-random values in [-1, 1).
fn values(seed: u64, n: usize) -> Vec<f32> {
    let mut x = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

const SHAPES: [(&str, &[i64]); 3] = [("a.weight", &[5, 3]), ("b.bias", &[4]), ("c.weight", &[2, 3, 4])];

fn params() -> Vec<(String, Tensor)> {
    SHAPES
        .iter()
        .enumerate()
        .map(|(i, (n, s))| {
            let numel = s.iter().product::<i64>() as usize;
            (n.to_string(), Tensor::from_slice(&values(i as u64, numel)).view(*s).set_requires_grad(true))
        })
        .collect()
}

fn grads(step: usize) -> BTreeMap<String, Vec<f32>> {
    SHAPES
        .iter()
        .enumerate()
        .map(|(i, (n, s))| {
            let numel = s.iter().product::<i64>() as usize;
            // Scaled per step so that the second moments change (and a tiny one tests ε).
            let scale = [1.0, 0.01, 3.0, 1e-4][step % 4];
            (n.to_string(), values(100 + 10 * step as u64 + i as u64, numel).iter().map(|v| v * scale).collect())
        })
        .collect()
}

fn set_grads(ps: &[(String, Tensor)], g: &BTreeMap<String, Vec<f32>>) {
    for (n, p) in ps {
        let mut grad = p.grad();
        if !grad.defined() {
            // Create the gradient buffer with a backward pass of a zero loss.
            (p * 0.0).sum(Kind::Float).backward();
            grad = p.grad();
        }
        grad.copy_(&Tensor::from_slice(&g[n]).view(p.size().as_slice()));
    }
}

/// The optimiser `name` (adamw or adafactor) with its defaults and `weight_decay`.
fn optimizer(name: &str, weight_decay: f64) -> OptimizerConfig {
    match name {
        "adamw" => OptimizerConfig::adamw(weight_decay),
        "adafactor" => OptimizerConfig::adafactor(weight_decay),
        other => panic!("no optimiser {other}"),
    }
    .unwrap()
}

fn flat(t: &Tensor) -> Vec<f32> {
    Vec::<f32>::try_from(t.flatten(0, -1)).unwrap()
}

fn compare(name: &str, cfg: OptimizerConfig, request: serde_json::Value, lrs: &[f64]) {
    let ps = params();
    let mut opt = Optimizer::new(cfg, ps.iter().map(|(n, p)| (n.clone(), p.shallow_clone())).collect());
    let mut req = request;
    req["params"] = json!(
        ps.iter()
            .map(|(n, p)| (n.clone(), json!({"shape": p.size(), "data": flat(p)})))
            .collect::<serde_json::Map<_, _>>()
    );
    req["grads"] = json!((0..lrs.len()).map(grads).collect::<Vec<_>>());
    req["lr"] = json!(lrs);
    let file = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("optim-{name}.json"));
    std::fs::write(&file, req.to_string()).unwrap();
    let out = std::process::Command::new(common::python())
        .arg(common::reference_script("optim.py"))
        .arg(&file)
        .output()
        .unwrap();
    assert!(out.status.success(), "reference failed: {}", String::from_utf8_lossy(&out.stderr));
    let want: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    for (step, lr) in lrs.iter().enumerate() {
        set_grads(&ps, &grads(step));
        opt.step(*lr).unwrap();
        for (n, p) in &ps {
            let w: Vec<f32> =
                want["steps"][step][n].as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32).collect();
            let got = flat(p);
            for (k, (a, b)) in got.iter().zip(&w).enumerate() {
                assert!((a - b).abs() <= 2e-6 * (1.0 + b.abs()), "{cfg:?} step {step} {n}[{k}]: {a} vs reference {b}");
            }
        }
    }
}

#[test]
fn adamw_matches_torch() {
    let cfg = OptimizerConfig::adamw(0.1).unwrap();
    compare("adamw", cfg, json!({"optimizer": "adamw", "weight_decay": 0.1}), &[1e-2, 5e-3, 2e-2, 1e-2, 1e-3]);
}

#[test]
fn adafactor_matches_transformers() {
    let cfg = OptimizerConfig::adafactor(0.05).unwrap();
    compare(
        "adafactor",
        cfg,
        json!({"optimizer": "adafactor", "weight_decay": 0.05, "beta1": null, "scale_parameter": false}),
        &[1e-2, 5e-3, 2e-2, 1e-2, 1e-3],
    );
}

#[test]
fn adafactor_with_momentum_and_parameter_scale_matches_transformers() {
    let OptimizerConfig::Adafactor { eps1, eps2, clip_threshold, decay_rate, .. } =
        OptimizerConfig::adafactor(0.0).unwrap()
    else {
        unreachable!()
    };
    let cfg = OptimizerConfig::Adafactor {
        beta1: Some(0.9),
        eps1,
        eps2,
        clip_threshold,
        decay_rate,
        weight_decay: 0.0,
        scale_parameter: true,
    };
    compare(
        "adafactor-momentum",
        cfg,
        json!({"optimizer": "adafactor", "weight_decay": 0.0, "beta1": 0.9, "scale_parameter": true}),
        &[1e-1, 5e-2, 1e-1, 1e-1],
    );
}

/// Two steps, save, a fresh optimiser loads the state and takes two more: the same parameters as
/// four steps in one go.
#[test]
fn saved_state_resumes_exactly() {
    for name in ["adamw", "adafactor"] {
        let cfg = optimizer(name, 0.01);
        let run = |split: bool| {
            let ps = params();
            let named = || ps.iter().map(|(n, p)| (n.clone(), p.shallow_clone())).collect();
            let mut opt = Optimizer::new(cfg, named());
            for step in 0..4 {
                if split && step == 2 {
                    let state = opt.state();
                    opt = Optimizer::new(cfg, named());
                    opt.load_state(state).unwrap();
                }
                set_grads(&ps, &grads(step));
                opt.step(1e-2).unwrap();
            }
            assert_eq!(opt.steps(), 4);
            ps.iter().map(|(_, p)| flat(p)).collect::<Vec<_>>()
        };
        assert_eq!(run(false), run(true), "{name}");
    }
}

#[test]
fn refuses_a_state_of_another_model() {
    let cfg = OptimizerConfig::adafactor(0.0).unwrap();
    let ps = params();
    let mut opt = Optimizer::new(cfg, ps.iter().map(|(n, p)| (n.clone(), p.shallow_clone())).collect());
    set_grads(&ps, &grads(0));
    opt.step(1e-2).unwrap();
    let mut state = opt.state();
    state.insert("z.weight.exp_avg_sq".into(), Tensor::zeros([2], (Kind::Float, tch::Device::Cpu)));
    let err = Optimizer::new(cfg, params()).load_state(state).unwrap_err().to_string();
    assert!(err.contains("z.weight"), "{err}");
    let mut state = opt.state();
    state.insert("a.weight.exp_avg_sq_row".into(), Tensor::zeros([7], (Kind::Float, tch::Device::Cpu)));
    let err = Optimizer::new(cfg, params()).load_state(state).unwrap_err().to_string();
    assert!(err.contains("shape"), "{err}");
    // A damaged state is an error, not a panic: a factored moment of a vector, a step of two values.
    let mut state = opt.state();
    state.insert("b.bias.exp_avg_sq_col".into(), Tensor::zeros([4], (Kind::Float, tch::Device::Cpu)));
    let err = Optimizer::new(cfg, params()).load_state(state).unwrap_err().to_string();
    assert!(err.contains("b.bias.exp_avg_sq_col"), "{err}");
    let mut state = opt.state();
    state.insert("step".into(), Tensor::from_slice(&[1i64, 2]));
    let err = Optimizer::new(cfg, params()).load_state(state).unwrap_err().to_string();
    assert!(err.contains("step"), "{err}");
    // An unknown optimiser name is refused by the CLI (tests/cli.rs); a negative weight decay here.
    assert!(OptimizerConfig::adamw(-1.0).is_err());
    assert!(OptimizerConfig::adafactor(f64::NAN).is_err());
    assert!(opt.step(f64::NAN).is_err());
}

/// bf16 parameters follow an f32 master copy: a long run of updates far smaller than a bf16 ulp
/// moves them as far as the same run in f32 (to within one bf16 rounding), instead of being
/// rounded away step after step.
#[test]
fn half_precision_parameters_keep_small_updates() {
    for name in ["adamw", "adafactor"] {
        let cfg = optimizer(name, 0.0);
        let run = |kind: Kind| {
            let p = Tensor::ones([4, 3], (kind, tch::Device::Cpu)).set_requires_grad(true);
            let mut opt = Optimizer::new(cfg, vec![("w".into(), p.shallow_clone())]);
            for step in 0..200 {
                let g = Tensor::from_slice(&values(step, 12)).view([4, 3]).abs() + 0.5; // always > 0
                set_grads(
                    &[("w".into(), p.shallow_clone())],
                    &[("w".to_string(), Vec::<f32>::try_from(&g.flatten(0, -1)).unwrap())].into(),
                );
                opt.step(1e-4).unwrap();
            }
            p.detach().to_kind(Kind::Float)
        };
        let (full, half) = (run(Kind::Float), run(Kind::BFloat16));
        let moved = (1.0 - full.max().double_value(&[])).abs();
        assert!(moved > 0.01, "{name}: the f32 run moved only {moved}");
        let err = (&full - &half).abs().max().double_value(&[]);
        assert!(err <= 0.0079, "{name}: bf16 run is {err} from the f32 run (it moved {moved})");
    }
}
