//! Loading and saving checkpoints in the Hugging Face layout: `config.json`, `model.safetensors`
//! or shards listed in `model.safetensors.index.json`, and the tokenizer files beside them.

use crate::config::LlamaConfig;
use crate::model::{Kernels, Llama};
use crate::tokenizer::Tokenizer;
use anyhow::{Context, Result, bail};
use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::path::{Path, PathBuf};
use tch::{Device, Kind, Tensor};

/// The tokenizer and generation files copied along with a saved model.
const SIDE_FILES: [&str; 6] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
    "chat_template.json",
];

/// The safetensors files of a checkpoint directory.
pub(crate) fn weight_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let single = dir.join("model.safetensors");
    if single.exists() {
        return Ok(vec![single]);
    }
    let index = dir.join("model.safetensors.index.json");
    if index.exists() {
        let text = std::fs::read_to_string(&index)?;
        let v: serde_json::Value =
            serde_json::from_str(&text).with_context(|| format!("parsing {}", index.display()))?;
        let map = v.get("weight_map").and_then(|m| m.as_object()).context("index without a weight_map")?;
        let files: BTreeSet<&str> = map.values().filter_map(|f| f.as_str()).collect();
        return Ok(files.into_iter().map(|f| dir.join(f)).collect());
    }
    bail!("{} holds neither model.safetensors nor model.safetensors.index.json", dir.display())
}

/// Loads a Hugging Face Llama directory onto `device` in `kind` (weights are converted).
pub fn load(dir: &Path, device: Device, kind: Kind) -> Result<Llama> {
    let cfg = LlamaConfig::load(dir)?;
    let files = weight_files(dir)?;
    // Sizes that the weight files cannot hold (at least one byte per parameter) are a corrupt
    // config: refused before the model is allocated.
    let bytes: u64 = files.iter().map(|f| std::fs::metadata(f).map(|m| m.len()).unwrap_or(0)).sum();
    if cfg.parameter_count() > bytes as f64 {
        bail!(
            "{}: its sizes make {:.3e} parameters, more than the {bytes} bytes of its weight files hold",
            dir.join("config.json").display(),
            cfg.parameter_count()
        );
    }
    let model = Llama::new(cfg, device, kind)?;
    read_weights(&model, &files, dir)?;
    Ok(model)
}

/// Where and in which dtype a model is loaded.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Placement {
    pub device: Device,
    /// The weights' dtype (converted on load): `Kind::Float`, `Kind::BFloat16` or `Kind::Half`.
    pub kind: Kind,
    /// The kernels of generation ([`Kernels::Onednn`] by default: it applies on the CPU only).
    pub kernels: Kernels,
    /// Whether generation on a CUDA device replays CUDA graphs ([`Llama::cuda_graphs`]).
    pub cuda_graphs: bool,
}

impl Placement {
    /// f32 on `device`, default kernels, no CUDA graphs.
    pub fn f32(device: Device) -> Self {
        Self { device, kind: Kind::Float, kernels: Kernels::Onednn, cuda_graphs: false }
    }
}

/// Loads the model of `dir` and its tokenizer, logging what was loaded and how long it took to
/// stderr. CUDA graphs asked for on a CUDA device by a build without them
/// ([`crate::cuda_graph::available`]) are refused before anything is read.
pub fn open(dir: &Path, at: Placement) -> Result<(Llama, Tokenizer)> {
    if at.cuda_graphs && at.device.is_cuda() && !crate::cuda_graph::available() {
        bail!(
            "CUDA graphs were asked for on {:?}, but this build has none (its libtorch is not a CUDA build, or the CUDA headers were missing when it was built): leave out --cuda-graphs",
            at.device
        );
    }
    let t0 = std::time::Instant::now();
    let mut m = load(dir, at.device, at.kind).with_context(|| format!("loading {}", dir.display()))?;
    m.set_kernels(at.kernels);
    m.set_cuda_graphs(at.cuda_graphs);
    let tok = Tokenizer::load(dir, &m.cfg)?;
    eprintln!(
        "loaded {} ({} layers, {:?}, {:?}) in {:.1} s",
        dir.display(),
        m.cfg.num_hidden_layers,
        at.kind,
        at.device,
        t0.elapsed().as_secs_f64()
    );
    Ok((m, tok))
}

/// The model's tensors by name (a name-ordered map, so that writing them is deterministic).
pub fn weights(model: &Llama) -> BTreeMap<String, Tensor> {
    model.vs.variables().into_iter().collect()
}

/// Copies the tensors of safetensors `files` into the model's variables (converting the dtype),
/// refusing a tensor of the wrong shape, one that is not part of the model, or a missing one
/// (`what` names the whole in messages).
pub fn read_weights(model: &Llama, files: &[PathBuf], what: &Path) -> Result<()> {
    let vars = model.vs.variables();
    let mut loaded = BTreeSet::new();
    for file in files {
        let tensors = Tensor::read_safetensors(file).with_context(|| format!("reading {}", file.display()))?;
        for (name, t) in tensors {
            match vars.get(&name) {
                Some(var) => {
                    if var.size() != t.size() {
                        bail!("{}: {name} has shape {:?}, the model {:?}", file.display(), t.size(), var.size());
                    }
                    tch::no_grad(|| var.shallow_clone().copy_(&t.to_kind(var.kind())));
                    // After the conversion: a value that overflows the dtype is refused too.
                    if !bool::try_from(var.isfinite().all())? {
                        bail!(
                            "{}: {name} holds non-finite values (NaN or infinite) in {:?}",
                            file.display(),
                            var.kind()
                        );
                    }
                    loaded.insert(name);
                }
                None if name == "lm_head.weight" && model.cfg.tie_word_embeddings => {}
                None if name.ends_with("rotary_emb.inv_freq") => {}
                None => bail!("{}: unexpected tensor {name} (not part of a Llama model)", file.display()),
            }
        }
    }
    let missing: Vec<&String> = vars.keys().filter(|k| !loaded.contains(*k)).collect();
    if !missing.is_empty() {
        bail!("{}: missing tensors {missing:?}", what.display());
    }
    Ok(())
}

fn dtype_name(kind: Kind) -> Result<&'static str> {
    Ok(match kind {
        Kind::Float => "F32",
        Kind::BFloat16 => "BF16",
        Kind::Half => "F16",
        Kind::Int64 => "I64",
        other => bail!("cannot save a {other:?} tensor"),
    })
}

fn torch_dtype_name(kind: Kind) -> &'static str {
    match kind {
        Kind::BFloat16 => "bfloat16",
        Kind::Half => "float16",
        _ => "float32",
    }
}

/// Writes tensors to a safetensors file with the `{"format": "pt"}` metadata transformers expects,
/// atomically (see [`crate::io::write_atomic`]).
pub fn write_safetensors(tensors: &BTreeMap<String, Tensor>, path: &Path) -> Result<()> {
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), serde_json::json!({"format": "pt"}));
    let mut offset = 0usize;
    let mut blobs = vec![];
    for (name, t) in tensors {
        let t = t.detach().to_device(Device::Cpu).contiguous();
        let bytes = t.numel() * t.kind().elt_size_in_bytes();
        header.insert(
            name.clone(),
            serde_json::json!({"dtype": dtype_name(t.kind())?, "shape": t.size(), "data_offsets": [offset, offset + bytes]}),
        );
        offset += bytes;
        blobs.push(t);
    }
    let mut json = serde_json::to_vec(&serde_json::Value::Object(header))?;
    while json.len() % 8 != 0 {
        json.push(b' ');
    }
    crate::io::write_atomic(path, |f| {
        f.write_all(&(json.len() as u64).to_le_bytes())?;
        f.write_all(&json)?;
        for t in blobs {
            let mut buf = vec![0u8; t.numel() * t.kind().elt_size_in_bytes()];
            t.f_copy_data_u8(&mut buf, t.numel())?;
            f.write_all(&buf)?;
        }
        Ok(())
    })
}

/// Saves `model` as a Hugging Face directory `out` (config, one safetensors file, and the
/// tokenizer and generation files copied from `source`, the directory it was loaded from).
///
/// Every file is written atomically: a failed save leaves each file whole (old or new).
pub fn save(model: &Llama, source: &Path, out: &Path) -> Result<()> {
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let mut cfg = serde_json::to_value(&model.cfg)?;
    if let Some(o) = cfg.as_object_mut() {
        o.insert("torch_dtype".into(), torch_dtype_name(model.kind()).into());
        o.insert("dtype".into(), torch_dtype_name(model.kind()).into());
        o.insert("architectures".into(), serde_json::json!(["LlamaForCausalLM"]));
    }
    // config.json last: a directory with one is taken for a whole model.
    if source != out {
        for f in SIDE_FILES {
            let from = source.join(f);
            if from.exists() {
                let bytes = std::fs::read(&from).with_context(|| format!("reading {}", from.display()))?;
                crate::io::write_file(&out.join(f), bytes)?;
            }
        }
    }
    write_safetensors(&weights(model), &out.join("model.safetensors"))?;
    crate::io::write_file(&out.join("config.json"), serde_json::to_string_pretty(&cfg)?)?;
    Ok(())
}
