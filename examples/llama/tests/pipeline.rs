//! The data pipeline of the Llama library: sampling a graded data set (resumable, deterministic)
//! and evaluation metrics, on a small random checkpoint.

mod common;

use common::random_checkpoint;
use std::path::PathBuf;
use tch::{Device, Kind, Tensor};
use topr_llama::generate::SamplingParams;
use topr_llama::shard::Shard;
use topr_llama::{checkpoint, eval, generate, model, sample, task, tokenizer, train};

/// libtorch's random generator is global to the process: tests that sample run one at a time,
/// or their draws interleave.
static SAMPLING: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn setup(name: &str) -> (model::Llama, tokenizer::Tokenizer, PathBuf) {
    let dir = random_checkpoint(name, &["--kv-heads", "2", "--seed", "11"]);
    let m = checkpoint::load(&dir, Device::Cpu, Kind::Float).unwrap();
    let tok = tokenizer::Tokenizer::load(&dir, &m.cfg).unwrap();
    (m, tok, dir)
}

#[test]
fn sampling_resumes_after_a_kill_and_gives_the_same_data_set() {
    let _one_at_a_time = SAMPLING.lock().unwrap_or_else(|e| e.into_inner());
    let (m, tok, dir) = setup("pipeline_sample");
    let problems = task::synthetic_problems(5, 7, 2);
    let params = SamplingParams { temperature: 1.0, top_p: 0.95, top_k: 50 };
    let s = generate::Sampling::sample(params, 10);
    let style = eval::PromptStyle::Chat;
    // Outputs never go into the model's own directory.
    let data = dir.with_extension("data");
    let _ = std::fs::remove_dir_all(&data);
    std::fs::create_dir_all(&data).unwrap();
    let full = data.join("full.jsonl");
    let settings = |sampling| sample::SampleSettings {
        samples_per_prompt: 3,
        sampling,
        seed: 42,
        batch_prompts: 2,
        shard: Shard::WHOLE,
    };
    let n = sample::sample_dataset(&m, &tok, &dir, &problems, &style, &settings(s), &full).unwrap();
    assert_eq!(n, 21);
    // A run killed within its fourth prompt, in the middle of a batch of two: three prompts are
    // written, the fourth cut short (the record of how it was sampled is written before the
    // first line).
    let killed = data.join("killed.jsonl");
    let text = std::fs::read_to_string(&full).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    let partial = format!("{}\n{}\n{}", lines[..9].join("\n"), lines[9], &lines[10][..20]);
    std::fs::write(&killed, partial).unwrap();
    std::fs::copy(sample::run_file(&full), sample::run_file(&killed)).unwrap();
    let n2 = sample::sample_dataset(&m, &tok, &dir, &problems, &style, &settings(s), &killed).unwrap();
    assert_eq!(n2, 12, "the incomplete prompt is redone, nothing before it");
    assert_eq!(std::fs::read_to_string(&killed).unwrap(), text, "same seed, same data set");
    // Killed inside a character of the cut line (completions hold non-ASCII text): the same.
    let mut bytes = format!("{}\n{}\n{{\"completion\": \"", lines[..9].join("\n"), lines[9]).into_bytes();
    bytes.push("é".as_bytes()[0]);
    let killed_utf8 = data.join("killed-utf8.jsonl");
    std::fs::write(&killed_utf8, bytes).unwrap();
    std::fs::copy(sample::run_file(&full), sample::run_file(&killed_utf8)).unwrap();
    let n3 = sample::sample_dataset(&m, &tok, &dir, &problems, &style, &settings(s), &killed_utf8).unwrap();
    assert_eq!((n3, std::fs::read_to_string(&killed_utf8).unwrap()), (12, text.clone()), "cut inside a character");
    // Other batchings (one prompt, every prompt at once in flight) write the same file.
    for batch_prompts in [1, 7] {
        let other = data.join(format!("batch-{batch_prompts}.jsonl"));
        let how = sample::SampleSettings { batch_prompts, ..settings(s) };
        sample::sample_dataset(&m, &tok, &dir, &problems, &style, &how, &other).unwrap();
        assert_eq!(std::fs::read_to_string(&other).unwrap(), text, "{batch_prompts} prompts in flight");
    }
    // A complete file is never regenerated.
    assert_eq!(sample::sample_dataset(&m, &tok, &dir, &problems, &style, &settings(s), &full).unwrap(), 0);
    // Other settings or other problems on an existing file are refused, naming what differs.
    let other = generate::Sampling::sample(SamplingParams { temperature: 0.7, ..params }, 10);
    let err = sample::sample_dataset(&m, &tok, &dir, &problems, &style, &settings(other), &full).unwrap_err();
    assert!(err.to_string().contains("sampling.temperature 1.0 → 0.7"), "{err}");
    let err = sample::sample_dataset(&m, &tok, &dir, &problems[1..], &style, &settings(s), &full).unwrap_err();
    assert!(err.to_string().contains("problems 7 → 6") && err.to_string().contains("prompts.hash"), "{err}");

    // Every record is consistent: μ's sequence log-prob is the sum of its token log-probs, the
    // token log-probs are those the model assigns (teacher-forced), rewards match correctness.
    let (data, skipped) = sample::read_dataset(&full, false).unwrap();
    assert_eq!((data.len(), skipped), (21, 0));
    for d in &data {
        assert_eq!(d.completion_ids.len(), d.logp_mu.len());
        let sum: f64 = d.logp_mu.iter().map(|&x| x as f64).sum();
        assert!((sum - d.seq_logp_mu).abs() < 1e-4);
        assert_eq!(d.reward, if d.correct { 1.0 } else { -1.0 });
        assert_eq!(d.invalid, d.answer.is_none());
        let scored = generate::score(&m, &d.prompt_ids, &d.completion_ids).unwrap();
        for (a, b) in scored.iter().zip(&d.logp_mu) {
            assert!((a - b).abs() < 1e-4, "teacher-forced {a} vs sampled {b}");
        }
        // Top-k/top-p only remove mass: the sampling distribution gives each kept token at least
        // its model probability.
        for (q, p) in d.logp_sampling.iter().zip(&d.logp_mu) {
            assert!(q + 1e-5 >= *p, "log q {q} < log π {p}");
        }
    }
}

#[test]
fn malformed_data_set_lines_are_named_or_skipped() {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    let path = dir.join("bad_dataset.jsonl");
    std::fs::write(&path, "{\"id\": 1}\n").unwrap();
    let err = sample::read_dataset(&path, false).unwrap_err();
    assert!(format!("{err:#}").contains("bad_dataset.jsonl:1"), "{err:#}");
    assert_eq!(sample::read_dataset(&path, true).unwrap().1, 1);
}

#[test]
fn evaluation_metrics_are_consistent() {
    let _one_at_a_time = SAMPLING.lock().unwrap_or_else(|e| e.into_inner());
    let (m, tok, dir) = setup("pipeline_eval");
    let problems = task::synthetic_problems(9, 5, 1);
    let settings = eval::EvalSettings {
        max_new_tokens: 8,
        samples: 3,
        sampling: SamplingParams::default(),
        batch_size: 4,
        seed: 0,
        shard: Shard::WHOLE,
    };
    let out = dir.join("eval.jsonl");
    let mut f = std::fs::File::create(&out).unwrap();
    let summary = eval::evaluate(&m, &tok, &problems, &eval::PromptStyle::Chat, &settings, Some(&mut f)).unwrap();
    assert_eq!(summary.questions, 5);
    assert_eq!(std::fs::read_to_string(&out).unwrap().lines().count(), 5);
    let (p1, maj, pk) = (summary.pass1_sampled.unwrap(), summary.maj_at_k.unwrap(), summary.pass_at_k.unwrap());
    assert!((0.0..=1.0).contains(&p1) && maj <= pk && p1 <= pk);
    assert!(summary.mean_tokens_greedy > 0.0 && summary.mean_tokens_greedy <= 8.0);
    // maj@k by hand.
    assert_eq!(eval::majority(&[Some(3.0), None, Some(4.0), Some(3.0)]), Some(3.0));
    assert_eq!(eval::majority(&[None, None]), None);
}

/// A fresh data set of `problems`, `samples_per_prompt` each, sampled by the checkpoint `name`
/// (`budget` tokens, seed `seed`, `batch_prompts` in flight), read back; with the model.
fn sampled_data(
    name: &str,
    problems: &[task::Problem],
    samples_per_prompt: usize,
    budget: i64,
    seed: i64,
    batch_prompts: usize,
) -> (model::Llama, Vec<topr_llama::dataset::Sample>) {
    let (m, tok, dir) = setup(name);
    let s = generate::Sampling::sample(SamplingParams::default(), budget);
    let path = dir.with_extension("data.jsonl");
    let _ = std::fs::remove_file(&path);
    let _ = std::fs::remove_file(sample::run_file(&path));
    let settings = sample::SampleSettings { samples_per_prompt, sampling: s, seed, batch_prompts, shard: Shard::WHOLE };
    sample::sample_dataset(&m, &tok, &dir, problems, &eval::PromptStyle::Chat, &settings, &path).unwrap();
    (m, sample::read_dataset(&path, false).unwrap().0)
}

/// A micro-batch of prompts of different lengths: the training forward makes logits from the
/// shortest prompt's last position on only, and each completion token's log-prob there is the
/// one of its own sequence's full forward (no padding, no other row); the mask and μ's log-probs
/// sit in the same columns.
#[test]
fn a_micro_batch_trains_on_its_completions_logits_only() {
    let _one_at_a_time = SAMPLING.lock().unwrap_or_else(|e| e.into_inner());
    let (m, mut data) = sampled_data("pipeline_from", &task::synthetic_problems(17, 4, 1), 1, 7, 5, 4);
    // Prompts cut by 0, 5, 10 and 15 tokens, completions of 1 to 4 tokens: the shortest prompt
    // is not the first row's, and the longest sequence is not the shortest prompt's.
    for (i, d) in data.iter_mut().enumerate() {
        d.prompt_ids.drain(..5 * i);
        d.completion_ids.truncate(1 + (i * 3) % 4);
        d.logp_mu = (0..d.completion_ids.len()).map(|k| -(i as f32) - k as f32 / 8.0).collect();
    }
    let rows: Vec<(&topr_llama::dataset::Sample, f32)> = data.iter().map(|d| (d, 1.0)).collect();
    let p = train::micro_batch(&rows, Device::Cpu);
    let shortest = data.iter().map(|d| d.prompt_ids.len()).min().unwrap() as i64;
    let longest = data.iter().map(|d| d.prompt_ids.len() + d.completion_ids.len()).max().unwrap() as i64;
    assert_eq!(p.from, shortest - 1);
    assert_eq!(p.mask.size(), [4, longest - 1 - p.from]);
    let logits = tch::no_grad(|| m.next_token_logits(&p.ids, &p.attn, p.from)).unwrap();
    assert_eq!(logits.size(), [4, longest - 1 - p.from, m.cfg.vocab_size]);
    let cfg = topr_loss::LogProbConfig::default();
    let lp = topr_loss::token_logprobs(&logits, &p.labels, Some(&p.mask), &cfg).unwrap();
    let at = |t: &Tensor, r: usize, c: i64| t.double_value(&[r as i64, c]);
    let mut seen = 0;
    for (r, d) in data.iter().enumerate() {
        let all: Vec<i64> = d.prompt_ids.iter().chain(&d.completion_ids).copied().collect();
        let n = all.len() as i64;
        let ids = Tensor::from_slice(&all).view([1, n]);
        let full = tch::no_grad(|| m.logits(&ids, &Tensor::ones([1, n], (Kind::Bool, Device::Cpu)))).unwrap();
        let own = full.log_softmax(-1, Kind::Double);
        let pl = d.prompt_ids.len() as i64;
        for (k, &y) in d.completion_ids.iter().enumerate() {
            let col = pl + k as i64 - 1 - p.from;
            assert!(bool::try_from(p.mask.get(r as i64).get(col)).unwrap(), "row {r} token {k}");
            assert_eq!(at(&p.labels, r, col), y as f64);
            assert_eq!(at(&p.logp_mu, r, col), f64::from(d.logp_mu[k]));
            let want = own.double_value(&[0, pl + k as i64 - 1, y]);
            let got = at(&lp.logp, r, col);
            assert!((got - want).abs() < 1e-4, "row {r} token {k}: {got} against its own forward's {want}");
            seen += 1;
        }
    }
    // Nothing else is a completion token.
    assert_eq!(p.mask.sum(Kind::Int64).int64_value(&[]), seen);
    // from must lie inside the batch.
    assert!(m.next_token_logits(&p.ids, &p.attn, longest).is_err());
    assert!(m.next_token_logits(&p.ids, &p.attn, -1).is_err());
    // Empty completions behind prompts of one length keep one masked column, not a width of zero
    // that the losses would refuse as an empty batch.
    let n = data.iter().map(|d| d.prompt_ids.len()).min().unwrap().min(5);
    assert!(n >= 2);
    for d in data.iter_mut() {
        d.prompt_ids.truncate(n);
        d.completion_ids.clear();
        d.logp_mu.clear();
    }
    let rows: Vec<(&topr_llama::dataset::Sample, f32)> = data.iter().map(|d| (d, 1.0)).collect();
    let p = train::micro_batch(&rows, Device::Cpu);
    assert_eq!((p.from, p.mask.size()), (n as i64 - 2, vec![4, 1]));
    assert_eq!(p.mask.sum(Kind::Int64).int64_value(&[]), 0);
    let logits = tch::no_grad(|| m.next_token_logits(&p.ids, &p.attn, p.from)).unwrap();
    assert_eq!(logits.size(), [4, 1, m.cfg.vocab_size]);
    // So do one-token prompts: a padding position is added after them.
    for d in data.iter_mut() {
        d.prompt_ids.truncate(1);
    }
    let rows: Vec<(&topr_llama::dataset::Sample, f32)> = data.iter().map(|d| (d, 1.0)).collect();
    let p = train::micro_batch(&rows, Device::Cpu);
    assert_eq!((p.from, p.ids.size(), p.mask.size()), (0, vec![4, 2], vec![4, 1]));
    assert_eq!((p.mask.sum(Kind::Int64).int64_value(&[]), p.attn.sum(Kind::Int64).int64_value(&[])), (0, 4));
    let logits = tch::no_grad(|| m.next_token_logits(&p.ids, &p.attn, p.from)).unwrap();
    assert_eq!(logits.size(), [4, 1, m.cfg.vocab_size]);
}

/// The gradient of one optimiser step is the same whatever the micro-batch size, for every ratio
/// level (the aggregation uses the counts of the whole step).
#[test]
fn gradient_accumulation_does_not_depend_on_the_micro_batch_size() {
    let _one_at_a_time = SAMPLING.lock().unwrap_or_else(|e| e.into_inner());
    let (m, mut data) = sampled_data("pipeline_accumulate", &task::synthetic_problems(13, 3, 1), 2, 9, 3, 3);
    // Mixed rewards and lengths, so that every branch and the padding are exercised.
    for (i, d) in data.iter_mut().enumerate() {
        d.reward = if i % 3 == 0 { 1.0 } else { -1.0 };
        let keep = 3 + i % 6;
        d.completion_ids.truncate(keep);
        d.logp_mu.truncate(keep);
    }
    let vars = m.vs.trainable_variables();
    let topr = |ratio| {
        train::Loss::Topr(
            topr_loss::ToprTokenConfig::paper()
                .with_topr(topr_loss::ToprConfig::canonical().with_baseline(0.2))
                .with_ratio(ratio),
        )
    };
    let cases = [
        ("topr sequence", train::Objective::Topr, topr(topr_loss::RatioLevel::Sequence)),
        ("topr sequence-mean", train::Objective::Topr, topr(topr_loss::RatioLevel::SequenceMean)),
        ("topr token", train::Objective::Topr, topr(topr_loss::RatioLevel::Token)),
        ("ppo", train::Objective::Ppo, train::Loss::Ppo(topr_loss::PpoConfig::ppo())),
        (
            "grpo",
            train::Objective::Grpo,
            train::Loss::Ppo(
                topr_loss::PpoConfig::ppo().with_aggregation(topr_loss::AggregationMode::SeqMeanTokenMean),
            ),
        ),
        (
            "dpo",
            train::Objective::Dpo,
            train::Loss::Dpo(topr_loss::DpoConfig::default(), topr_loss::SequenceReduce::Sum),
        ),
        ("gspo", train::Objective::Gspo, train::Loss::Gspo(topr_loss::PpoConfig::gspo().with_clip(0.1, 0.1))),
        ("cispo", train::Objective::Cispo, train::Loss::Cispo(topr_loss::PpoConfig::cispo())),
        ("sapo", train::Objective::Sapo, train::Loss::Sapo(topr_loss::SapoConfig::sapo())),
        ("gmpo", train::Objective::Gmpo, train::Loss::Gmpo(topr_loss::GmpoConfig::gmpo())),
        ("vespo", train::Objective::Vespo, train::Loss::Vespo(topr_loss::VespoConfig::vespo())),
        (
            "prefix-ratio",
            train::Objective::PrefixRatio,
            train::Loss::PrefixRatio(topr_loss::PrefixRatioConfig::ctpo_la()),
        ),
        (
            "decoupled-ppo log-linear",
            train::Objective::DecoupledPpo,
            train::Loss::DecoupledPpo(
                topr_loss::DecoupledPpoConfig::areal(),
                topr_llama::settings::Proximal::LogLinear,
            ),
        ),
        (
            "decoupled-ppo recomputed",
            train::Objective::DecoupledPpo,
            train::Loss::DecoupledPpo(topr_loss::DecoupledPpoConfig::verl(), topr_llama::settings::Proximal::Recompute),
        ),
    ];
    // Decoupled PPO's proximal policy: the model as it starts, perturbed so that it differs from
    // π; the log-linear one at staleness 1 + 3.
    let start = m.frozen_copy().unwrap();
    tch::no_grad(|| {
        for v in start.vs.variables().values() {
            let _ = v.shallow_clone().g_add_(&(v.randn_like() * 0.01));
        }
    });
    // What every token-level loss can get besides its terms; the top-entropy selection and the
    // covariance losses select per micro-batch, so they are not split-invariant and not here.
    let extras = [
        train::Extras::default(),
        train::Extras {
            correction: Some(topr_loss::RolloutCorrection::sequence_tis(1.5)),
            kl: Some(topr_loss::KlConfig::k3().with_coef(0.1)),
            entropy: Some(topr_loss::EntropyConfig::bonus().with_coef(0.01)),
            ..Default::default()
        },
    ];
    // π ≠ μ, so that ratios differ from 1 and clipping and truncation are exercised.
    for d in data.iter_mut() {
        for (k, lp) in d.logp_mu.iter_mut().enumerate() {
            *lp += if k % 2 == 0 { 0.3 } else { -0.25 };
        }
    }
    for ((name, objective, loss), extras) in cases
        .into_iter()
        .flat_map(|c| extras.iter().map(move |e| (c, e)))
        .filter(|((_, o, _), e)| *o != train::Objective::Dpo || e.kl.is_none())
    {
        let units = train::units(&data, objective, 0.1).unwrap();
        let completions: usize = units.iter().map(|u| u.completions()).sum();
        assert!(completions >= 4, "{name}: {completions} completions");
        let mut grads = vec![];
        let mut losses = vec![];
        for micro in [1, 2, 4, 6] {
            for v in &vars {
                let mut g = v.grad();
                if g.defined() {
                    let _ = g.zero_();
                }
            }
            let at = train::StepAt { seed: 0, index: 3, start: Some(&start) };
            let st = train::accumulate(&m, &units, micro, &loss, extras, at, None).unwrap();
            assert_eq!(st.sequences, completions);
            losses.push(st.loss);
            grads.push(tch::Tensor::cat(&vars.iter().map(|v| v.grad().flatten(0, -1)).collect::<Vec<_>>(), 0));
        }
        let scale = grads[0].abs().max().double_value(&[]);
        assert!(scale > 0.0, "{name}: zero gradient");
        for (k, g) in grads.iter().enumerate().skip(1) {
            let d = (g - &grads[0]).abs().max().double_value(&[]);
            assert!(d <= 1e-5 * scale, "{name} {extras:?}: micro-batch variant {k} differs by {d} (scale {scale})");
            assert!((losses[k] - losses[0]).abs() <= 1e-5 * losses[0].abs().max(1e-3), "{name}: loss {losses:?}");
        }
    }
    // The units themselves: GRPO's advantages per question, DPO's (correct, incorrect) pairs.
    let values = |o| -> Vec<f32> {
        train::units(&data, o, 0.1)
            .unwrap()
            .iter()
            .map(|u| match u {
                train::Unit::Single(_, v) => *v,
                train::Unit::Pair(..) => unreachable!(),
            })
            .collect()
    };
    let a = std::f32::consts::FRAC_1_SQRT_2; // (±1 − 0) / std([1, −1]) with the unbiased std √2
    let grpo = values(train::Objective::Grpo);
    assert!(grpo.iter().zip([a, -a, -a, a, 0.0, 0.0]).all(|(x, y)| (x - y).abs() < 1e-5), "{grpo:?}");
    assert_eq!(values(train::Objective::Ppo), vec![0.9, -1.1, -1.1, 0.9, -1.1, -1.1]);
    let pairs: Vec<(usize, usize)> = train::units(&data, train::Objective::Dpo, 0.0)
        .unwrap()
        .iter()
        .map(|u| match u {
            train::Unit::Pair(w, l) => (w.sample + 10 * w.id.len(), l.sample + 10 * l.id.len()),
            train::Unit::Single(..) => unreachable!(),
        })
        .collect();
    assert_eq!(pairs.len(), 2, "{pairs:?}");
    for d in data.iter_mut() {
        d.reward = -1.0;
    }
    let err = train::units(&data, train::Objective::Dpo, 0.0).unwrap_err().to_string();
    assert!(err.contains("both a correct and an incorrect"), "{err}");
    // The schedule: warm-up then linear decay.
    assert_eq!(train::learning_rate(1.0, 0, 10, 2, true), 0.5);
    assert_eq!(train::learning_rate(1.0, 2, 10, 2, true), 1.0);
    assert_eq!(train::learning_rate(1.0, 6, 10, 2, true), 0.5);
    assert_eq!(train::learning_rate(1.0, 6, 10, 2, false), 1.0);
}
