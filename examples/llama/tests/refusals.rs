//! The library's reading and checking functions on arbitrary input: data-set records, configs,
//! GSM8K lines and model sizes. None may panic; what they accept must be consistent. And a model
//! whose weights went bad after loading is refused by generation and scoring, not sampled from.

use proptest::prelude::*;
use serde_json::{Value, json};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use tch::{Device, Kind};
use topr_llama::config::{LlamaConfig, MAX_PARAMETERS};
use topr_llama::generate::{self, Sampling, SamplingParams};
use topr_llama::{checkpoint, init, sample, task, train};

/// A fresh file path under the test temp dir.
fn scratch(name: &str) -> PathBuf {
    static N: AtomicUsize = AtomicUsize::new(0);
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("llama_refusals");
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(format!("{name}-{}-{}.jsonl", std::process::id(), N.fetch_add(1, Ordering::Relaxed)))
}

/// Any JSON value, small.
fn any_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        (-3i64..300).prop_map(Value::from),
        any::<f64>().prop_filter("JSON numbers are finite", |f| f.is_finite()).prop_map(Value::from),
        ".{0,6}".prop_map(Value::from),
    ];
    leaf.prop_recursive(2, 12, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::from),
            prop::collection::btree_map("[a-z_]{1,6}", inner, 0..3)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// A field value: mostly of the right shape (so that records get past parsing), sometimes anything.
fn field(right: impl Strategy<Value = Value> + 'static) -> impl Strategy<Value = Option<Value>> {
    prop_oneof![8 => right.prop_map(Some), 1 => any_json().prop_map(Some), 1 => Just(None)]
}

fn ids() -> impl Strategy<Value = Value> {
    prop::collection::vec(prop_oneof![8 => 0i64..270, 1 => any::<i64>()], 0..6).prop_map(|v| json!(v))
}

fn logps() -> impl Strategy<Value = Value> {
    prop::collection::vec(prop_oneof![-30.0f64..0.0, Just(-1e300), Just(1e39)], 0..6).prop_map(|v| json!(v))
}

fn number() -> impl Strategy<Value = Value> {
    prop_oneof![(-2.0f64..2.0).prop_map(Value::from), Just(json!(1e308)), Just(json!(-1.0))]
}

/// A data-set record: every field of `Sample`, each of the right shape or not, or missing.
fn record() -> impl Strategy<Value = Value> {
    let strings = || ".{0,8}".prop_map(Value::from);
    let fields = (
        (field(strings()), field((0u64..4).prop_map(Value::from)), field(strings()), field(ids()), field(strings())),
        (field(ids()), field(logps()), field(logps()), field(number()), field(number())),
        (field(prop_oneof![number(), Just(Value::Null)]), field(number()), field(any::<bool>().prop_map(Value::from))),
        (
            field(any::<bool>().prop_map(Value::from)),
            field(number()),
            field(prop_oneof![Just(json!("eos")), Just(json!("length"))]),
        ),
        field(Just(json!({"temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_new_tokens": 8, "seed": 0}))),
    );
    fields.prop_map(|((a, b, c, d, e), (f, g, h, i, j), (k, l, m), (n, o, p), q)| {
        let names = [
            "id",
            "sample",
            "question",
            "prompt_ids",
            "completion",
            "completion_ids",
            "logp_mu",
            "logp_sampling",
            "seq_logp_mu",
            "seq_logp_sampling",
            "answer",
            "reference",
            "correct",
            "invalid",
            "reward",
            "stop",
            "sampling",
        ];
        let values = [a, b, c, d, e, f, g, h, i, j, k, l, m, n, o, p, q];
        Value::Object(names.iter().zip(values).filter_map(|(n, v)| v.map(|v| (n.to_string(), v))).collect())
    })
}

/// A data-set file: records and garbage lines, possibly cut short anywhere.
fn dataset() -> impl Strategy<Value = String> {
    let line = prop_oneof![6 => record().prop_map(|r| r.to_string()), 1 => any_json().prop_map(|v| v.to_string()), 1 => ".{0,20}"];
    (prop::collection::vec(line, 0..6), any::<bool>(), any::<prop::sample::Index>()).prop_map(|(lines, cut, at)| {
        let text = lines.join("\n") + "\n";
        if cut && !text.is_empty() {
            let mut k = at.index(text.len());
            while !text.is_char_boundary(k) {
                k -= 1;
            }
            text[..k].to_string()
        } else {
            text
        }
    })
}

fn config() -> impl Strategy<Value = Value> {
    let size = || prop_oneof![(-2i64..70).prop_map(Value::from), any::<i64>().prop_map(Value::from), any_json()];
    let id = || prop_oneof![(-2i64..300).prop_map(Value::from), Just(json!([1, 2])), Just(json!([0, 999]))];
    (
        (field(size()), field(size()), field(size()), field(size()), field(size())),
        (field(size()), field(size()), field(prop_oneof![number(), Just(json!(0.0)), Just(json!(1e-5))]), field(size())),
        (field(id()), field(id()), field(id())),
        field(prop_oneof![
            Just(json!({"rope_type": "default", "rope_theta": 10000.0})),
            Just(json!({"rope_type": "llama3", "rope_theta": -1.0, "factor": 8.0})),
            Just(json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})),
            any_json(),
        ]),
    )
        .prop_map(|((a, b, c, d, e), (f, g, h, i), (j, k, l), m)| {
            let names = [
                "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "bos_token_id",
                "eos_token_id", "pad_token_id", "rope_parameters",
            ];
            let values = [a, b, c, d, e, f, g, h, i, j, k, l, m];
            Value::Object(names.iter().zip(values).filter_map(|(n, v)| v.map(|v| (n.to_string(), v))).collect())
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    /// Reading a data set never panics; what it returns passes the record check, and a record it
    /// refuses is named by file and line.
    #[test]
    fn reading_arbitrary_data_sets_never_panics(text in dataset(), vocab in 1i64..300, skip in any::<bool>()) {
        let path = scratch("data");
        std::fs::write(&path, &text).unwrap();
        match sample::read_dataset_for(&path, Some(vocab), skip) {
            Ok((records, _)) => {
                for r in &records {
                    prop_assert!(r.check(Some(vocab)).is_ok());
                    prop_assert!(r.prompt_ids.iter().chain(&r.completion_ids).all(|&i| (0..vocab).contains(&i)));
                    prop_assert_eq!(r.logp_mu.len(), r.completion_ids.len());
                }
            }
            Err(e) => prop_assert!(e.to_string().contains(&path.display().to_string()), "{e:#}"),
        }
        let _ = sample::read_dataset(&path, skip);
        let _ = train::load_data(&path, 16, vocab, skip);
        std::fs::remove_file(&path).unwrap();
    }

    /// Parsing an arbitrary config never panics; an accepted one has usable sizes.
    #[test]
    fn parsing_arbitrary_configs_never_panics(cfg in config()) {
        if let Ok(c) = LlamaConfig::parse(&cfg.to_string()) {
            prop_assert!(c.vocab_size >= 1 && c.num_hidden_layers >= 1 && c.head_dim() >= 1 && c.head_dim() % 2 == 0);
            prop_assert!(c.num_attention_heads % c.num_kv_heads() == 0);
            prop_assert!(c.rms_norm_eps > 0.0 && c.parameter_count() <= MAX_PARAMETERS);
            prop_assert!(c.eos_ids().iter().all(|&i| (0..c.vocab_size).contains(&i)));
        }
    }

    /// The sizes of a new model: refused or valid, never a panic.
    #[test]
    fn arbitrary_init_sizes_never_panic(
        layers in prop_oneof![-2i64..8, any::<i64>()], hidden in prop_oneof![-2i64..130, any::<i64>()],
        heads in prop_oneof![-2i64..9, any::<i64>()], kv_heads in prop_oneof![-2i64..9, any::<i64>()],
        intermediate in prop_oneof![-2i64..400, any::<i64>()], max_positions in prop_oneof![-2i64..600, any::<i64>()],
    ) {
        let size = init::Size { layers, hidden, heads, kv_heads, intermediate, max_positions };
        if let Ok(c) = init::config(&size, init::vocab_size()) {
            prop_assert!(c.parameter_count() <= init::MAX_INIT_PARAMETERS);
        }
    }

    /// Reading GSM8K lines never panics.
    #[test]
    fn reading_arbitrary_gsm8k_lines_never_panics(
        lines in prop::collection::vec(prop_oneof![
            ("[ -~]{0,12}", "[ -~#<>]{0,16}").prop_map(|(q, a)| json!({"question": q, "answer": a}).to_string()),
            any_json().prop_map(|v| v.to_string()),
            "[ -~]{0,20}",
        ], 0..5),
        skip in any::<bool>(),
    ) {
        let path = scratch("gsm8k");
        std::fs::write(&path, lines.join("\n")).unwrap();
        if let Ok((problems, _)) = task::load_gsm8k(&path, skip) {
            prop_assert!(problems.iter().all(|p| p.answer.is_finite()));
        }
        std::fs::remove_file(&path).unwrap();
    }
}

/// Weights that turn non-finite after loading (here set by hand) make generation and scoring
/// fail with an error, where a multinomial draw would panic and argmax would print garbage.
#[test]
fn non_finite_logits_are_refused_by_generation_and_scoring() {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("llama_refusals_model");
    let _ = std::fs::remove_dir_all(&dir);
    let size = init::Size { layers: 1, hidden: 16, heads: 2, kv_heads: 1, intermediate: 32, max_positions: 64 };
    init::init(&dir, size, 0).unwrap();
    let m = checkpoint::load(&dir, Device::Cpu, Kind::Float).unwrap();
    tch::no_grad(|| {
        let _ = m.vs.variables()["model.norm.weight"].shallow_clone().fill_(f64::NAN);
    });
    let prompt = vec![vec![1i64, 2, 3]];
    for s in [Sampling::greedy(4), Sampling::sample(SamplingParams::default(), 4)] {
        let err = generate::generate(&m, &prompt, &s, &[257], 0).unwrap_err();
        assert!(err.to_string().contains("not finite"), "{err:#}");
    }
    assert!(generate::score(&m, &[1, 2], &[3]).unwrap_err().to_string().contains("not finite"));
    // Token ids outside the vocabulary are refused, not looked up.
    let err = generate::generate(&m, &[vec![1, 9999]], &Sampling::greedy(2), &[257], 0).unwrap_err();
    assert!(err.to_string().contains("9999"), "{err:#}");
}

/// `--cuda-graphs` on a CUDA device is refused up front by a build without CUDA graphs, before
/// the model is read; a build with them goes on to read the model (here a folder that does not
/// exist, so the error is about the folder instead).
#[test]
fn cuda_graphs_without_the_shim_are_refused_before_loading() {
    let dir = scratch("no-such-model");
    let at = checkpoint::Placement { cuda_graphs: true, ..checkpoint::Placement::f32(Device::Cuda(0)) };
    let err = format!("{:#}", checkpoint::open(&dir, at).err().expect("a missing model loads"));
    let refused = err.contains("CUDA graphs were asked for") && err.contains("--cuda-graphs");
    assert_eq!(refused, !topr_llama::cuda_graph::available(), "{err}");
    // Without the flag, or on the CPU, nothing is refused for it.
    for at in [
        checkpoint::Placement::f32(Device::Cuda(0)),
        checkpoint::Placement { cuda_graphs: true, ..checkpoint::Placement::f32(Device::Cpu) },
    ] {
        let err = format!("{:#}", checkpoint::open(&dir, at).err().expect("a missing model loads"));
        assert!(!err.contains("CUDA graphs were asked for"), "{err}");
    }
}
