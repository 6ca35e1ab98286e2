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
        let cfg: Self = serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
        cfg.check().with_context(|| format!("unsupported checkpoint {}", path.display()))?;
        Ok(cfg)
    }

    pub fn num_kv_heads(&self) -> i64 {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    pub fn head_dim(&self) -> i64 {
        self.head_dim.unwrap_or(self.hidden_size / self.num_attention_heads)
    }

    /// Refuses what would be computed differently from transformers' `LlamaForCausalLM`.
    pub fn check(&self) -> Result<()> {
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
        let Some(p) = params.filter(|p| !p.is_null()) else {
            return Ok(Rope { theta, llama3: None });
        };
        let kind = p.get("rope_type").or_else(|| p.get("type")).and_then(Value::as_str).unwrap_or("default");
        let num = |k: &str| -> Result<f64> {
            p.get(k).and_then(Value::as_f64).with_context(|| format!("rope scaling {kind:?} needs a numeric {k:?}"))
        };
        match kind {
            "default" => Ok(Rope { theta, llama3: None }),
            "llama3" => Ok(Rope {
                theta,
                llama3: Some(Llama3Scaling {
                    factor: num("factor")?,
                    low_freq_factor: num("low_freq_factor")?,
                    high_freq_factor: num("high_freq_factor")?,
                    original_max_position_embeddings: num("original_max_position_embeddings")?,
                }),
            }),
            other => bail!("rope_type {other:?} is not supported (only default and llama3)"),
        }
    }

    /// Every end-of-sequence id named in the config (an int or a list).
    pub fn eos_ids(&self) -> Vec<i64> {
        ids(self.eos_token_id.as_ref())
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
