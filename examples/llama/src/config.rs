//! `config.json` of a Hugging Face Llama checkpoint: parsing, defaults, and a refusal of every
//! setting this implementation does not reproduce exactly.

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::path::Path;

/// The fields of a Llama `config.json` this model reads. Unknown fields are kept (in `extra`) so
/// that a saved checkpoint carries them unchanged.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LlamaConfig {
    #[serde(default = "default_model_type")]
    pub model_type: String,
    pub vocab_size: i64,
    pub hidden_size: i64,
    pub intermediate_size: i64,
    pub num_hidden_layers: i64,
    pub num_attention_heads: i64,
    #[serde(default)]
    pub num_key_value_heads: Option<i64>,
    #[serde(default)]
    pub head_dim: Option<i64>,
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f64,
    /// transformers < 5 writes `rope_theta` and `rope_scaling`; 5 writes `rope_parameters`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_theta: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_scaling: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_parameters: Option<Value>,
    #[serde(default = "default_max_pos")]
    pub max_position_embeddings: i64,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    #[serde(default)]
    pub bos_token_id: Option<Value>,
    #[serde(default)]
    pub eos_token_id: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pad_token_id: Option<Value>,
    #[serde(default = "default_act")]
    pub hidden_act: String,
    #[serde(default)]
    pub attention_bias: bool,
    #[serde(default)]
    pub mlp_bias: bool,
    #[serde(flatten)]
    pub extra: serde_json::Map<String, Value>,
}

fn default_model_type() -> String {
    "llama".into()
}
fn default_eps() -> f64 {
    1e-6
}
fn default_max_pos() -> i64 {
    2048
}
fn default_act() -> String {
    "silu".into()
}

/// The rotary embedding, resolved from either config layout.
#[derive(Debug, Clone, PartialEq)]
pub struct Rope {
    pub theta: f64,
    pub llama3: Option<Llama3Scaling>,
}

/// The `rope_type: llama3` frequency scaling of Llama 3.1 and 3.2.
#[derive(Debug, Clone, PartialEq)]
pub struct Llama3Scaling {
    pub factor: f64,
    pub low_freq_factor: f64,
    pub high_freq_factor: f64,
    pub original_max_position_embeddings: f64,
}

impl LlamaConfig {
    pub fn load(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
        Self::parse(&text).with_context(|| path.display().to_string())
    }

    /// Parses the text of a `config.json` and [`check`](Self::check)s it: malformed JSON, missing
    /// fields, invalid values and unsupported settings are errors naming the field.
    pub fn parse(text: &str) -> Result<Self> {
        let cfg: Self = serde_json::from_str(text).context("not a Llama config.json")?;
        cfg.check()?;
        Ok(cfg)
    }

    pub fn num_kv_heads(&self) -> i64 {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    pub fn head_dim(&self) -> i64 {
        self.head_dim.unwrap_or(self.hidden_size / self.num_attention_heads)
    }

    /// Refuses invalid values (sizes < 1, a hidden size that the heads do not divide, a
    /// non-positive `rms_norm_eps`, special token ids outside the vocabulary, …) and what would be
    /// computed differently from transformers' `LlamaForCausalLM`. Errors name the field.
    pub fn check(&self) -> Result<()> {
        self.check_values()?;
        if self.model_type != "llama" {
            bail!("model_type is {:?}; only \"llama\" is supported", self.model_type);
        }
        if self.hidden_act != "silu" {
            bail!("hidden_act is {:?}; only \"silu\" (SwiGLU) is supported", self.hidden_act);
        }
        if self.attention_bias || self.mlp_bias {
            bail!("attention_bias / mlp_bias are not supported");
        }
        if self.num_attention_heads % self.num_kv_heads() != 0 {
            bail!(
                "num_attention_heads {} is not a multiple of num_key_value_heads {}",
                self.num_attention_heads,
                self.num_kv_heads()
            );
        }
        if self.head_dim() % 2 != 0 {
            bail!("head_dim {} must be even for rotary embeddings", self.head_dim());
        }
        if let Some(tp) = self.extra.get("pretraining_tp").and_then(Value::as_i64) {
            if tp != 1 {
                bail!("pretraining_tp = {tp} is not supported (only 1)");
            }
        }
        self.rope()?;
        Ok(())
    }

    /// The values every Llama needs, each with its field's name in the error. Checked before
    /// anything divides by them.
    fn check_values(&self) -> Result<()> {
        let sizes = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("max_position_embeddings", self.max_position_embeddings),
        ];
        for (field, v) in sizes {
            if v < 1 {
                bail!("{field} must be >= 1, got {v}");
            }
        }
        if let Some(v) = self.num_key_value_heads {
            if v < 1 {
                bail!("num_key_value_heads must be >= 1, got {v}");
            }
        }
        match self.head_dim {
            Some(v) if v < 1 => bail!("head_dim must be >= 1, got {v}"),
            Some(_) => {}
            None if self.hidden_size % self.num_attention_heads != 0 => bail!(
                "hidden_size {} is not a multiple of num_attention_heads {} (and no head_dim is given)",
                self.hidden_size,
                self.num_attention_heads
            ),
            None => {}
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0) {
            bail!("rms_norm_eps must be finite and > 0, got {}", self.rms_norm_eps);
        }
        for (field, v) in [
            ("bos_token_id", &self.bos_token_id),
            ("eos_token_id", &self.eos_token_id),
            ("pad_token_id", &self.pad_token_id),
        ] {
            check_token_ids(field, v.as_ref(), self.vocab_size)?;
        }
        if self.parameter_count() > MAX_PARAMETERS {
            bail!("the sizes make {:.3e} parameters, more than any Llama this loads", self.parameter_count());
        }
        Ok(())
    }

    /// The number of parameters these sizes make (as f64: it cannot overflow), the tied output
    /// projection counted once.
    pub fn parameter_count(&self) -> f64 {
        let (v, h, i) = (self.vocab_size as f64, self.hidden_size as f64, self.intermediate_size as f64);
        let (nh, nkv, hd) = (
            self.num_attention_heads as f64,
            self.num_key_value_heads.unwrap_or(self.num_attention_heads) as f64,
            self.head_dim.unwrap_or(self.hidden_size / self.num_attention_heads.max(1)) as f64,
        );
        let layer = 2.0 * h * nh * hd + 2.0 * h * nkv * hd + 3.0 * h * i + 2.0 * h;
        let head = if self.tie_word_embeddings { 0.0 } else { v * h };
        v * h + head + self.num_hidden_layers as f64 * layer + h
    }

    /// The rotary settings from `rope_parameters` (transformers 5) or `rope_theta` +
    /// `rope_scaling` (earlier versions).
    pub fn rope(&self) -> Result<Rope> {
        let params = self.rope_parameters.as_ref().or(self.rope_scaling.as_ref());
        let theta = self
            .rope_parameters
            .as_ref()
            .and_then(|p| p.get("rope_theta"))
            .and_then(Value::as_f64)
            .or(self.rope_theta)
            .unwrap_or(10_000.0);
        if !(theta.is_finite() && theta > 0.0) {
            bail!("rope_theta must be finite and > 0, got {theta}");
        }
        let Some(p) = params.filter(|p| !p.is_null()) else {
            return Ok(Rope { theta, llama3: None });
        };
        let kind = p.get("rope_type").or_else(|| p.get("type")).and_then(Value::as_str).unwrap_or("default");
        let num = |k: &str| -> Result<f64> {
            let v = p
                .get(k)
                .and_then(Value::as_f64)
                .with_context(|| format!("rope scaling {kind:?} needs a numeric {k:?}"))?;
            if !(v.is_finite() && v > 0.0) {
                bail!("rope scaling {k} must be finite and > 0, got {v}");
            }
            Ok(v)
        };
        match kind {
            "default" => Ok(Rope { theta, llama3: None }),
            "llama3" => {
                let s = Llama3Scaling {
                    factor: num("factor")?,
                    low_freq_factor: num("low_freq_factor")?,
                    high_freq_factor: num("high_freq_factor")?,
                    original_max_position_embeddings: num("original_max_position_embeddings")?,
                };
                if s.high_freq_factor <= s.low_freq_factor {
                    bail!(
                        "rope scaling high_freq_factor ({}) must exceed low_freq_factor ({})",
                        s.high_freq_factor,
                        s.low_freq_factor
                    );
                }
                Ok(Rope { theta, llama3: Some(s) })
            }
            other => bail!("rope_type {other:?} is not supported (only default and llama3)"),
        }
    }

    /// Every end-of-sequence id named in the config (an int or a list).
    pub fn eos_ids(&self) -> Vec<i64> {
        ids(self.eos_token_id.as_ref())
    }
}

/// More parameters than this (10^12, about 4 TB in f32) is a corrupt config, refused before
/// anything is allocated.
pub const MAX_PARAMETERS: f64 = 1e12;

/// A special token id field: absent, null, or an int or list of ints in `0..vocab`.
fn check_token_ids(field: &str, v: Option<&Value>, vocab: i64) -> Result<()> {
    let bad = |x: &Value| -> Result<()> {
        match x.as_i64() {
            Some(id) if (0..vocab).contains(&id) => Ok(()),
            Some(id) => bail!("{field} {id} lies outside the vocabulary (vocab_size {vocab})"),
            None => bail!("{field} must be a token id (an integer), got {x}"),
        }
    };
    match v {
        None | Some(Value::Null) => Ok(()),
        Some(Value::Array(a)) => a.iter().try_for_each(bad),
        Some(x) => bad(x),
    }
}

/// Token ids from a JSON int or list of ints.
pub fn ids(v: Option<&Value>) -> Vec<i64> {
    match v {
        Some(Value::Number(n)) => n.as_i64().into_iter().collect(),
        Some(Value::Array(a)) => a.iter().filter_map(Value::as_i64).collect(),
        _ => vec![],
    }
}
