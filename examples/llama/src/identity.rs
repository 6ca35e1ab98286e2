//! What a resumable run was made from, recorded when it starts and compared when it resumes: the
//! input model ([`ModelId`]), the data ([`Digest`] of a file or of records) and the settings
//! (serialised from their typed structs). [`differences`] lists, field by field, what changed,
//! so that a resume with another setting is refused saying which.

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};

/// A 64-bit FNV-1a hash: stable across builds, platforms and Rust versions (unlike `std`'s
/// `DefaultHasher`), so that a state saved by one build is recognised by the next.
#[derive(Clone, Copy)]
pub struct Fnv(u64);

impl Default for Fnv {
    fn default() -> Self {
        Self(0xcbf2_9ce4_8422_2325)
    }
}

impl Fnv {
    pub fn bytes(&mut self, bytes: &[u8]) -> &mut Self {
        for b in bytes {
            self.0 ^= u64::from(*b);
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
        self
    }

    pub fn hex(&self) -> String {
        format!("{:016x}", self.0)
    }

    /// FNV-1a over little-endian 64-bit words (the tail, under 8 bytes, byte by byte): the
    /// same kind of hash at about eight times the speed, for gigabytes of weights. A stream's
    /// hash depends on where its calls split it only at multiples of 8 bytes.
    pub fn words(&mut self, bytes: &[u8]) -> &mut Self {
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            let w = u64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]);
            self.0 ^= w;
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
        self.bytes(chunks.remainder())
    }

    /// The hash as a number (e.g. to order items stably).
    pub fn value(&self) -> u64 {
        self.0
    }
}

/// The size and hash of some bytes: a file's, or a set of records'.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Digest {
    pub bytes: u64,
    pub hash: String,
}

impl Digest {
    /// Of the file at `path`, read in blocks.
    pub fn of_file(path: &Path) -> Result<Self> {
        let mut h = Fnv::default();
        let n = for_each_block(path, 1 << 16, |b| {
            h.bytes(b);
        })?;
        Ok(Self { bytes: n, hash: h.hex() })
    }

    /// Of a sequence of records, each serialised as JSON.
    pub fn of_records<T: Serialize>(records: impl IntoIterator<Item = T>) -> Result<Self> {
        let (mut h, mut n) = (Fnv::default(), 0u64);
        for r in records {
            let s = serde_json::to_vec(&r)?;
            h.bytes(&s).bytes(b"\n");
            n += s.len() as u64 + 1;
        }
        Ok(Self { bytes: n, hash: h.hex() })
    }
}

/// Feeds the file at `path` to `f` in blocks of `size` bytes, every block whole but the last
/// (however the reads split); returns the file's size.
fn for_each_block(path: &Path, size: usize, mut f: impl FnMut(&[u8])) -> Result<u64> {
    let ctx = || format!("reading {}", path.display());
    let mut file = std::fs::File::open(path).with_context(ctx)?;
    let (mut buf, mut total) = (vec![0u8; size], 0u64);
    loop {
        let mut k = 0;
        while k < size {
            let n = file.read(&mut buf[k..]).with_context(ctx)?;
            if n == 0 {
                break;
            }
            k += n;
        }
        f(&buf[..k]);
        total += k as u64;
        if k < size {
            return Ok(total);
        }
    }
}

/// A data file: where it is, its size and hash.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct FileId {
    pub path: PathBuf,
    #[serde(flatten)]
    pub digest: Digest,
}

impl FileId {
    pub fn of(path: &Path) -> Result<Self> {
        Ok(Self { path: crate::io::canonical(path)?, digest: Digest::of_file(path)? })
    }
}

/// A model directory: its canonical path, the hash of its `config.json`, the sizes of its
/// weight files and the hash of their content ([`ModelId::content`]): other weights at the same
/// path, of the same sizes, are another model.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ModelId {
    pub path: PathBuf,
    pub config: String,
    pub weights: BTreeMap<String, u64>,
    /// [`Fnv::words`] over the weight files' bytes, in name order (absent from records written
    /// before it existed: such a record does not match, since it cannot say which weights it
    /// was made from).
    #[serde(default)]
    pub content: Option<String>,
}

/// The content hashes computed by this process, by weight file and its size and modification
/// time: a model is read once per process however many stages record it.
type ContentCache = std::sync::Mutex<BTreeMap<(PathBuf, u64, std::time::SystemTime), String>>;

fn content_cache() -> &'static ContentCache {
    static CACHE: std::sync::OnceLock<ContentCache> = std::sync::OnceLock::new();
    CACHE.get_or_init(Default::default)
}

/// The [`Fnv::words`] hash of the file at `path` (of `size` bytes), from the cache when the file
/// has not changed since.
fn content_of(path: &Path, meta: &std::fs::Metadata) -> Result<String> {
    let key = (path.to_path_buf(), meta.len(), meta.modified().unwrap_or(std::time::UNIX_EPOCH));
    if let Some(h) = content_cache().lock().ok().and_then(|c| c.get(&key).cloned()) {
        return Ok(h);
    }
    // Whole blocks of 1 MiB (a multiple of 8 bytes) but the last: the hash is the file's.
    let mut h = Fnv::default();
    for_each_block(path, 1 << 20, |b| {
        h.words(b);
    })?;
    let hex = h.hex();
    if let Ok(mut c) = content_cache().lock() {
        c.insert(key, hex.clone());
    }
    Ok(hex)
}

impl ModelId {
    /// The identity of the model in `dir`: reads every weight file once per process (about a
    /// second a gigabyte).
    pub fn of(dir: &Path) -> Result<Self> {
        let config = Digest::of_file(&dir.join("config.json"))?.hash;
        let mut weights = BTreeMap::new();
        let mut content = Fnv::default();
        for f in crate::checkpoint::weight_files(dir)? {
            let meta = std::fs::metadata(&f).with_context(|| format!("reading {}", f.display()))?;
            let name = f.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
            content.bytes(name.as_bytes()).bytes(content_of(&f, &meta)?.as_bytes());
            weights.insert(name, meta.len());
        }
        Ok(Self { path: crate::io::canonical(dir)?, config, weights, content: Some(content.hex()) })
    }
}

/// The numerics a stage ran with, where they change its results: the weights' dtype, the
/// device's kind (`cpu`, `cuda`: devices of one kind compute alike) and the CPU's kernels
/// ([`crate::model::Kernels`]; `plain` on a GPU, where the setting does nothing). Recorded by
/// every resumable stage; records written before it existed read as f32 on the CPU with the
/// default kernels, which is what those versions ran unless told otherwise.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Numerics {
    pub dtype: String,
    pub device: String,
    pub kernels: String,
}

impl Default for Numerics {
    fn default() -> Self {
        Self { dtype: "f32".into(), device: "cpu".into(), kernels: "onednn".into() }
    }
}

impl Numerics {
    pub fn of(at: crate::checkpoint::Placement) -> Self {
        let dtype = match at.kind {
            tch::Kind::BFloat16 => "bf16".into(),
            tch::Kind::Half => "f16".into(),
            tch::Kind::Float => "f32".into(),
            other => format!("{other:?}"),
        };
        let cuda = at.device.is_cuda();
        let kernels = match at.kernels {
            crate::model::Kernels::Onednn if !cuda => "onednn",
            _ => "plain",
        };
        Self { dtype, device: if cuda { "cuda" } else { "cpu" }.into(), kernels: kernels.into() }
    }

    /// The numerics of a loaded model.
    pub fn of_model(m: &crate::model::Llama) -> Self {
        Self::of(crate::checkpoint::Placement {
            device: m.device(),
            kind: m.kind(),
            kernels: m.kernels(),
            cuda_graphs: false,
        })
    }

    /// `f32 on cpu (onednn kernels)`, as tables show it.
    pub fn describe(&self) -> String {
        format!("{} on {} ({} kernels)", self.dtype, self.device, self.kernels)
    }
}

/// A value as a message shows it: strings without quotes, `(none)` for null or missing.
fn show(v: Option<&Value>) -> String {
    match v {
        None | Some(Value::Null) => "(none)".into(),
        Some(Value::String(s)) => s.clone(),
        // Learning rates and the like as `1e-5`, not `0.00001`: the shorter of the two forms.
        Some(Value::Number(n)) if n.is_f64() => {
            let plain = n.to_string();
            match n.as_f64().map(|x| format!("{x:e}")) {
                Some(e) if e.len() < plain.len() => e,
                _ => plain,
            }
        }
        Some(other) => other.to_string(),
    }
}

fn diff(path: &str, a: Option<&Value>, b: Option<&Value>, out: &mut Vec<String>) {
    match (a, b) {
        (Some(Value::Object(x)), Some(Value::Object(y))) => {
            let keys: std::collections::BTreeSet<&String> = x.keys().chain(y.keys()).collect();
            for k in keys {
                let p = if path.is_empty() { k.clone() } else { format!("{path}.{k}") };
                diff(&p, x.get(k), y.get(k), out);
            }
        }
        _ if a == b => {}
        _ => out.push(format!("{path} {} → {}", show(a), show(b))),
    }
}

/// What differs between a saved record and the current one, field by field (nested fields
/// dotted: `model.config`, `optimizer.adamw.weight_decay`), each as `field saved → now`; the
/// fields in `ignore` (dotted paths) are not compared.
pub fn differences(saved: &Value, now: &Value, ignore: &[&str]) -> Vec<String> {
    let strip = |v: &Value| -> Value {
        let mut v = v.clone();
        for path in ignore {
            let mut parts: Vec<&str> = path.split('.').collect();
            let Some(last) = parts.pop() else { continue };
            let mut at = Some(&mut v);
            for p in parts {
                at = at.and_then(|x| x.get_mut(p));
            }
            if let Some(o) = at.and_then(|x| x.as_object_mut()) {
                o.remove(last);
            }
        }
        v
    };
    let mut out = vec![];
    diff("", Some(&strip(saved)), Some(&strip(now)), &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn differences_name_each_changed_field() {
        let a = serde_json::json!({"lr": 1e-5, "objective": "topr", "seed": 0, "opt": {"wd": 0.0}, "iterations": 3});
        let b = serde_json::json!({"lr": 2e-5, "objective": "ppo", "seed": 0, "opt": {"wd": 0.1}, "iterations": 1});
        assert_eq!(
            differences(&a, &b, &["iterations"]),
            ["lr 1e-5 → 2e-5", "objective topr → ppo", "opt.wd 0.0 → 0.1"].map(String::from)
        );
        assert!(differences(&a, &a, &[]).is_empty());
        assert_eq!(differences(&a, &b, &["iterations", "lr", "objective", "opt.wd"]), Vec::<String>::new());
        assert_eq!(Fnv::default().bytes(b"a").hex(), "af63dc4c8601ec8c");
    }
}
