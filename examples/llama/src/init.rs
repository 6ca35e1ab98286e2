//! A small Llama initialised from scratch, with a byte-level tokenizer built here (256 byte
//! tokens and 4 special tokens, no merges) and a chat template: a complete Hugging Face directory
//! that needs nothing downloaded, for the CPU demo.

use crate::checkpoint;
use crate::config::LlamaConfig;
use crate::model::Llama;
use anyhow::{Context, Result, anyhow, bail};
use serde_json::json;
use std::path::Path;
use tch::{Device, Kind};

pub const SPECIALS: [&str; 4] = ["<s>", "</s>", "<|user|>", "<|assistant|>"];
const CHAT_TEMPLATE: &str = "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] | trim }}</s>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}";

/// The sizes of the model to create.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Size {
    pub layers: i64,
    pub hidden: i64,
    pub heads: i64,
    pub kv_heads: i64,
    pub intermediate: i64,
    pub max_positions: i64,
}

/// The vocabulary size of the byte-level tokenizer: 256 byte tokens and the specials.
pub fn vocab_size() -> i64 {
    (tokenizers::pre_tokenizers::byte_level::ByteLevel::alphabet().len() + SPECIALS.len()) as i64
}

/// More parameters than this (2·10^9, 8 GB in f32) is not a model to make from scratch here
/// (Llama 3.2 1B's shape, 1.24·10^9, is the largest the GPU check makes).
pub const MAX_INIT_PARAMETERS: f64 = 2e9;

/// The `config.json` of a new model of `size` with `vocab` embedding rows: the byte-level
/// tokenizer's [`vocab_size`] ids, or more (ids the tokenizer never produces, so that the
/// embedding and output layer cost what a real vocabulary's do), checked: fewer rows than the
/// tokenizer's ids, sizes < 1, a hidden size the heads do not divide, an odd head size, query heads
/// that are not a multiple of the key-value heads, or more than [`MAX_INIT_PARAMETERS`] are
/// refused, naming the config field.
pub fn config(size: &Size, vocab: i64) -> Result<LlamaConfig> {
    let tokens = vocab_size();
    if vocab < tokens {
        bail!("vocab_size {vocab} is less than the byte-level tokenizer's {tokens} ids");
    }
    let cfg: LlamaConfig = serde_json::from_value(json!({
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": size.hidden,
        "intermediate_size": size.intermediate,
        "num_hidden_layers": size.layers,
        "num_attention_heads": size.heads,
        "num_key_value_heads": size.kv_heads,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "max_position_embeddings": size.max_positions,
        "tie_word_embeddings": true,
        "bos_token_id": tokens - 4,
        "eos_token_id": tokens - 3,
        "hidden_act": "silu"
    }))?;
    cfg.check()?;
    if cfg.parameter_count() > MAX_INIT_PARAMETERS {
        bail!(
            "these sizes make {:.3e} parameters, more than the {MAX_INIT_PARAMETERS:.0e} of a model made from scratch here",
            cfg.parameter_count()
        );
    }
    Ok(cfg)
}

/// `tokenizer.json` of a byte-level BPE without merges: one token per byte, plus the specials.
fn byte_tokenizer_json() -> serde_json::Value {
    let mut alphabet: Vec<char> = tokenizers::pre_tokenizers::byte_level::ByteLevel::alphabet().into_iter().collect();
    alphabet.sort_unstable();
    let mut vocab = serde_json::Map::new();
    for (i, c) in alphabet.iter().enumerate() {
        vocab.insert(c.to_string(), json!(i));
    }
    let base = alphabet.len();
    for (k, s) in SPECIALS.iter().enumerate() {
        vocab.insert(s.to_string(), json!(base + k));
    }
    let added: Vec<serde_json::Value> = SPECIALS
        .iter()
        .enumerate()
        .map(|(k, s)| json!({"id": base + k, "content": s, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}))
        .collect();
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 0}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [base], "tokens": ["<s>"]}}
        },
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": vocab, "merges": []}
    })
}

/// Writes a randomly initialised Llama (weights `N(0, 0.02)`, norms 1, as transformers
/// initialises them) with the byte-level tokenizer to `out`.
pub fn init(out: &Path, size: Size, seed: i64) -> Result<()> {
    init_with_vocab(out, size, vocab_size(), seed)
}

/// [`init`] with `vocab` embedding rows (at least [`vocab_size`]; see [`config`]).
pub fn init_with_vocab(out: &Path, size: Size, vocab: i64, seed: i64) -> Result<()> {
    // Everything is checked before the directory is created: a refused size leaves nothing behind.
    let tok = byte_tokenizer_json();
    let tokens = tok["model"]["vocab"].as_object().map(|v| v.len()).context("vocab")? as i64;
    let (bos, eos) = (tokens - 4, tokens - 3);
    let text = serde_json::to_string(&tok)?;
    text.parse::<tokenizers::Tokenizer>().map_err(|e| anyhow!("building the byte-level tokenizer: {e}"))?;
    let cfg = config(&size, vocab)?;
    if crate::io::holds_model(out) {
        bail!("{} holds a model already: choose another output directory, or remove it", out.display());
    }
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let _lock = crate::io::Lock::dir(out)?;
    let write = |p: &Path, t: String| crate::io::write_file(p, t);
    write(&out.join("tokenizer.json"), text)?;
    write(
        &out.join("tokenizer_config.json"),
        serde_json::to_string_pretty(
            &json!({"bos_token": "<s>", "eos_token": "</s>", "tokenizer_class": "PreTrainedTokenizerFast"}),
        )?,
    )?;
    write(&out.join("chat_template.jinja"), CHAT_TEMPLATE.to_string())?;
    write(
        &out.join("generation_config.json"),
        serde_json::to_string_pretty(&json!({"bos_token_id": bos, "eos_token_id": eos}))?,
    )?;
    let model = Llama::new(cfg, Device::Cpu, Kind::Float)?;
    tch::manual_seed(seed);
    // In name order: `variables()` is a hash map, whose order changes from run to run.
    tch::no_grad(|| {
        for (name, v) in checkpoint::weights(&model) {
            let mut v = v;
            if name.ends_with("norm.weight") {
                let _ = v.fill_(1.0);
            } else {
                let _ = v.normal_(0.0, 0.02);
            }
        }
    });
    checkpoint::save(&model, out, out)
}
