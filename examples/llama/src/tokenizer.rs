//! The tokenizer (`tokenizer.json`, through the `tokenizers` crate, offline) and the chat template
//! (`chat_template.jinja` or `tokenizer_config.json`, rendered with minijinja), plus the set of
//! end-of-sequence ids.

use crate::config::{LlamaConfig, ids};
use anyhow::{Context, Result, anyhow, bail};
use serde_json::Value;
use std::path::Path;

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    chat_template: Option<String>,
    bos_token: String,
    eos_token: String,
    /// Every id that ends a generation: the config's, generation_config.json's and the
    /// tokenizer's eos token.
    pub eos_ids: Vec<i64>,
    /// An id used to pad batches (never attended to).
    pub pad_id: i64,
    /// The model's vocabulary size: ids the tokenizer gives at or above it are refused.
    vocab_size: i64,
}

/// A special token given as a string or as `{"content": ...}`.
fn token_text(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content").and_then(Value::as_str).map(str::to_owned),
        _ => None,
    }
}

fn read_json(path: &Path) -> Result<Option<Value>> {
    if !path.exists() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(path)?;
    Ok(Some(serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?))
}

impl Tokenizer {
    pub fn load(dir: &Path, cfg: &LlamaConfig) -> Result<Self> {
        let path = dir.join("tokenizer.json");
        let inner = tokenizers::Tokenizer::from_file(&path).map_err(|e| anyhow!("loading {}: {e}", path.display()))?;
        let tc = read_json(&dir.join("tokenizer_config.json"))?.unwrap_or(Value::Null);
        let jinja = dir.join("chat_template.jinja");
        let chat_template = if jinja.exists() {
            Some(std::fs::read_to_string(&jinja)?)
        } else {
            match tc.get("chat_template") {
                Some(Value::String(s)) => Some(s.clone()),
                Some(Value::Array(list)) => list
                    .iter()
                    .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                    .and_then(|t| t.get("template"))
                    .and_then(Value::as_str)
                    .map(str::to_owned),
                _ => None,
            }
        };
        let bos_token = token_text(tc.get("bos_token")).unwrap_or_default();
        let eos_token = token_text(tc.get("eos_token")).unwrap_or_default();
        let mut eos_ids = cfg.eos_ids();
        let vocab = cfg.vocab_size;
        let outside = |file: &str, what: &str, id: i64| {
            anyhow!("{}: {what} {id} lies outside the vocabulary (vocab_size {vocab})", dir.join(file).display())
        };
        if let Some(gen_cfg) = read_json(&dir.join("generation_config.json"))? {
            let more = ids(gen_cfg.get("eos_token_id"));
            if let Some(&id) = more.iter().find(|&&i| !(0..vocab).contains(&i)) {
                return Err(outside("generation_config.json", "eos_token_id", id));
            }
            eos_ids.extend(more);
        }
        if let Some(id) = inner.token_to_id(&eos_token) {
            if id as i64 >= vocab {
                return Err(outside("tokenizer.json", &format!("the eos token {eos_token:?} has id"), id as i64));
            }
            eos_ids.push(id as i64);
        }
        eos_ids.sort_unstable();
        eos_ids.dedup();
        if eos_ids.is_empty() {
            bail!(
                "{}: no end-of-sequence token in config.json, generation_config.json or tokenizer_config.json",
                dir.display()
            );
        }
        let pad_id = ids(cfg.pad_token_id.as_ref()).first().copied().unwrap_or(eos_ids[0]);
        Ok(Self { inner, chat_template, bos_token, eos_token, eos_ids, pad_id, vocab_size: vocab })
    }

    /// Token ids of `text`, with the tokenizer's special tokens (BOS) when `special`.
    pub fn encode(&self, text: &str, special: bool) -> Result<Vec<i64>> {
        let enc = self.inner.encode(text, special).map_err(|e| anyhow!("tokenizing: {e}"))?;
        let ids: Vec<i64> = enc.get_ids().iter().map(|&i| i as i64).collect();
        if let Some(id) = ids.iter().find(|&&i| i >= self.vocab_size) {
            bail!("the tokenizer gives id {id}, outside the model's vocabulary (vocab_size {})", self.vocab_size);
        }
        Ok(ids)
    }

    /// Text of `ids`, without special tokens.
    pub fn decode(&self, ids: &[i64]) -> Result<String> {
        let ids: Vec<u32> = ids.iter().map(|&i| i as u32).collect();
        self.inner.decode(&ids, true).map_err(|e| anyhow!("decoding: {e}"))
    }

    /// The chat template applied to one user message, with the generation prompt, as
    /// `apply_chat_template(messages, add_generation_prompt=True, tokenize=False)` renders it.
    pub fn chat_prompt(&self, user: &str) -> Result<String> {
        self.render_chat(&[("user", user)], true)
    }

    pub fn render_chat(&self, messages: &[(&str, &str)], add_generation_prompt: bool) -> Result<String> {
        let template = self.chat_template.as_deref().context("this tokenizer has no chat template")?;
        let mut env = minijinja::Environment::new();
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> Result<String, minijinja::Error> {
            Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg))
        });
        env.add_function("strftime_now", |fmt: String| -> String { strftime_now(&fmt) });
        env.add_template("chat", template)?;
        let msgs: Vec<Value> = messages.iter().map(|(r, c)| serde_json::json!({"role": r, "content": c})).collect();
        let ctx = minijinja::context! {
            messages => msgs,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token.clone(),
            eos_token => self.eos_token.clone(),
        };
        Ok(env.get_template("chat")?.render(ctx)?)
    }

    /// Prompt ids as the CLI defines them: the chat template rendered and encoded without extra
    /// special tokens (the template carries them, as `apply_chat_template` does), or the raw
    /// text encoded with the tokenizer's special tokens.
    pub fn prompt_ids(&self, prompt: &str, chat: bool) -> Result<Vec<i64>> {
        if chat { self.encode(&self.chat_prompt(prompt)?, false) } else { self.encode(prompt, true) }
    }
}

/// The subset of `strftime` the chat templates use (`%d %b %Y`, `%B`, `%m`, `%y`, `%H:%M`), in UTC.
fn strftime_now(fmt: &str) -> String {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let days = (secs / 86_400) as i64;
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    let month = MONTHS[(m - 1) as usize];
    let (hh, mm) = ((secs % 86_400) / 3600, (secs % 3600) / 60);
    fmt.replace("%d", &format!("{d:02}"))
        .replace("%b", &month[..3])
        .replace("%B", month)
        .replace("%m", &format!("{m:02}"))
        .replace("%Y", &y.to_string())
        .replace("%y", &format!("{:02}", y % 100))
        .replace("%H", &format!("{hh:02}"))
        .replace("%M", &format!("{mm:02}"))
}
