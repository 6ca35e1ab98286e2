//! The Llama decoder (`LlamaForCausalLM` of transformers), written out with tch: RMSNorm,
//! rotary embeddings (with the llama3 frequency scaling), grouped-query attention, SwiGLU.
//!
//! Shapes: `B` batch, `T` new tokens, `S` cached + new tokens, `H` hidden size, `nh` / `nkv`
//! query / key-value heads, `hd` head size, `V` vocabulary.

use crate::config::{LlamaConfig, Rope};
use anyhow::Result;
use tch::nn::{self, Path};
use tch::{Device, Kind, Tensor};

struct Attention {
    q: Tensor, // [nh·hd, H]
    k: Tensor, // [nkv·hd, H]
    v: Tensor, // [nkv·hd, H]
    o: Tensor, // [H, nh·hd]
}

struct Mlp {
    gate: Tensor, // [I, H]
    up: Tensor,   // [I, H]
    down: Tensor, // [H, I]
}

struct Layer {
    input_norm: Tensor, // [H]
    attn: Attention,
    post_norm: Tensor, // [H]
    mlp: Mlp,
}

/// A Llama model whose parameters live in a `VarStore` under the Hugging Face names
/// (`model.layers.0.self_attn.q_proj.weight`, ...), so that an optimiser can train them and a
/// checkpoint maps one to one.
pub struct Llama {
    pub cfg: LlamaConfig,
    pub vs: nn::VarStore,
    embed: Tensor, // [V, H]
    layers: Vec<Layer>,
    norm: Tensor,     // [H]
    lm_head: Tensor,  // [V, H]; the embedding itself when tied
    inv_freq: Tensor, // [hd/2] f32
    kind: Kind,
}

/// Which keys each query attends to.
enum Attend {
    /// Key `j` for query `i` iff `j <= i` (no padding, no earlier cache).
    Causal,
    /// Every key (one new token, no padding in the cache).
    All,
    /// An explicit `[B, 1, T, S]` bool mask (padding present).
    Mask(Tensor),
}

/// Keys and values of past tokens, preallocated for `capacity` positions.
pub struct KvCache {
    k: Vec<Tensor>, // per layer [B, nkv, capacity, hd]
    v: Vec<Tensor>,
    /// `[B, capacity]` bool: which cached positions hold real tokens (false for left padding).
    key_mask: Tensor,
    /// Number of positions written so far.
    pub len: i64,
}

fn weight(p: &Path, dims: &[i64], kind: Kind) -> Tensor {
    p.add("weight", Tensor::zeros(dims, (kind, p.device())), true)
}

impl Llama {
    /// A model with zero weights of the given dtype on `device`; load a checkpoint into it.
    pub fn new(cfg: LlamaConfig, device: Device, kind: Kind) -> Result<Self> {
        let vs = nn::VarStore::new(device);
        let root = vs.root();
        let (h, i, hd) = (cfg.hidden_size, cfg.intermediate_size, cfg.head_dim());
        let (nh, nkv) = (cfg.num_attention_heads, cfg.num_kv_heads());
        let m = root.sub("model");
        let embed = weight(&m.sub("embed_tokens"), &[cfg.vocab_size, h], kind);
        let mut layers = vec![];
        for l in 0..cfg.num_hidden_layers {
            let p = m.sub("layers").sub(l);
            let a = p.sub("self_attn");
            let f = p.sub("mlp");
            layers.push(Layer {
                input_norm: weight(&p.sub("input_layernorm"), &[h], kind),
                attn: Attention {
                    q: weight(&a.sub("q_proj"), &[nh * hd, h], kind),
                    k: weight(&a.sub("k_proj"), &[nkv * hd, h], kind),
                    v: weight(&a.sub("v_proj"), &[nkv * hd, h], kind),
                    o: weight(&a.sub("o_proj"), &[h, nh * hd], kind),
                },
                post_norm: weight(&p.sub("post_attention_layernorm"), &[h], kind),
                mlp: Mlp {
                    gate: weight(&f.sub("gate_proj"), &[i, h], kind),
                    up: weight(&f.sub("up_proj"), &[i, h], kind),
                    down: weight(&f.sub("down_proj"), &[h, i], kind),
                },
            });
        }
        let norm = weight(&m.sub("norm"), &[h], kind);
        let lm_head = if cfg.tie_word_embeddings {
            embed.shallow_clone()
        } else {
            weight(&root.sub("lm_head"), &[cfg.vocab_size, h], kind)
        };
        let inv_freq = inv_freq(&cfg.rope()?, hd, device);
        Ok(Self { cfg, vs, embed, layers, norm, lm_head, inv_freq, kind })
    }

    pub fn kind(&self) -> Kind {
        self.kind
    }

    pub fn device(&self) -> Device {
        self.vs.device()
    }

    /// The output projection `[V, H]` (for the fused log-prob path).
    pub fn lm_head(&self) -> &Tensor {
        &self.lm_head
    }

    /// A cache for `batch` rows and `capacity` positions.
    pub fn new_cache(&self, batch: i64, capacity: i64) -> KvCache {
        let (nkv, hd) = (self.cfg.num_kv_heads(), self.cfg.head_dim());
        let opts = (self.kind, self.device());
        let mk = || (0..self.layers.len()).map(|_| Tensor::zeros([batch, nkv, capacity, hd], opts)).collect();
        KvCache { k: mk(), v: mk(), key_mask: Tensor::zeros([batch, capacity], (Kind::Bool, self.device())), len: 0 }
    }

    /// Final hidden states `[B, T, H]` (after the last RMSNorm) of a padded batch, without cache:
    /// the training forward. `mask [B, T]` is 1/true for real tokens; left or right padding both
    /// work (positions count real tokens only).
    pub fn hidden(&self, ids: &Tensor, mask: &Tensor) -> Tensor {
        let mask = mask.to_kind(Kind::Bool);
        let positions = positions_from_mask(&mask);
        if mask.all().int64_value(&[]) == 1 {
            // No padding: plain causal attention, which lets libtorch use its fused kernels.
            return self.run(ids, &positions, &Attend::Causal, None);
        }
        let t = ids.size()[1];
        // allowed[b, 0, i, j] = j <= i and key j is real; every query may see itself.
        let causal = Tensor::ones([t, t], (Kind::Bool, ids.device())).tril(0);
        let allowed =
            causal.unsqueeze(0).logical_and(&mask.unsqueeze(1)).logical_or(&Tensor::eye(t, (Kind::Bool, ids.device())));
        self.run(ids, &positions, &Attend::Mask(allowed.unsqueeze(1)), None)
    }

    /// Logits `[B, T, V]` of a padded batch (the training forward), in the model's dtype.
    pub fn logits(&self, ids: &Tensor, mask: &Tensor) -> Tensor {
        self.hidden(ids, mask).matmul(&self.lm_head.tr())
    }

    /// Feeds `ids [B, T]` at `positions [B, T]` through the model with a cache, marking them
    /// real where `new_mask [B, T]` is true; returns the logits of the last position `[B, V]`.
    pub fn step(&self, ids: &Tensor, positions: &Tensor, new_mask: &Tensor, cache: &mut KvCache) -> Tensor {
        let t = ids.size()[1];
        let start = cache.len;
        let total = start + t;
        cache.key_mask.narrow(1, start, t).copy_(&new_mask.to_kind(Kind::Bool));
        // allowed[b, 0, i, j] = key j real and j <= start + i; every query may see itself.
        let key_idx = Tensor::arange(total, (Kind::Int64, ids.device())).unsqueeze(0); // [1, S]
        let query_idx = Tensor::arange_start(start, total, (Kind::Int64, ids.device())).unsqueeze(1); // [T, 1]
        let causal = key_idx.le_tensor(&query_idx); // [T, S]
        let real = cache.key_mask.narrow(1, 0, total).unsqueeze(1); // [B, 1, S]
        let own = key_idx.eq_tensor(&query_idx); // [T, S]
        let no_padding = real.all().int64_value(&[]) == 1;
        let attend = if start == 0 && no_padding {
            Attend::Causal
        } else if t == 1 && no_padding {
            Attend::All // one new token that may see every (real) cached key
        } else {
            Attend::Mask(causal.unsqueeze(0).logical_and(&real).logical_or(&own.unsqueeze(0)).unsqueeze(1))
        };
        let h = self.run(ids, positions, &attend, Some(cache));
        cache.len = total;
        h.narrow(1, t - 1, 1).squeeze_dim(1).matmul(&self.lm_head.tr())
    }

    // `x = x + …` on purpose: tch's `+=` adds in place, which would modify a tensor that the
    // autograd graph saved for the backward pass.
    #[allow(clippy::assign_op_pattern)]
    fn run(&self, ids: &Tensor, positions: &Tensor, attend: &Attend, mut cache: Option<&mut KvCache>) -> Tensor {
        let (cos, sin) = rope_cos_sin(&self.inv_freq, positions, self.kind); // [B, 1, T, hd]
        let mut x = Tensor::embedding(&self.embed, ids, -1, false, false); // [B, T, H]
        for (l, layer) in self.layers.iter().enumerate() {
            let h = rms_norm(&x, &layer.input_norm, self.cfg.rms_norm_eps);
            let kv = cache.as_deref_mut().map(|c| (&mut c.k[l], &mut c.v[l], c.len));
            x = x + self.attention(&layer.attn, &h, &cos, &sin, attend, kv);
            let h = rms_norm(&x, &layer.post_norm, self.cfg.rms_norm_eps);
            let m = &layer.mlp;
            x = x + (h.matmul(&m.gate.tr()).silu() * h.matmul(&m.up.tr())).matmul(&m.down.tr());
        }
        rms_norm(&x, &self.norm, self.cfg.rms_norm_eps)
    }

    fn attention(
        &self,
        a: &Attention,
        h: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        attend: &Attend,
        cache: Option<(&mut Tensor, &mut Tensor, i64)>,
    ) -> Tensor {
        let (b, t) = (h.size()[0], h.size()[1]);
        let (nh, nkv, hd) = (self.cfg.num_attention_heads, self.cfg.num_kv_heads(), self.cfg.head_dim());
        let split = |w: &Tensor, n: i64| h.matmul(&w.tr()).view([b, t, n, hd]).transpose(1, 2); // [B, n, T, hd]
        let q = apply_rope(&split(&a.q, nh), cos, sin);
        let k = apply_rope(&split(&a.k, nkv), cos, sin);
        let v = split(&a.v, nkv);
        let (k, v) = match cache {
            Some((ck, cv, start)) => {
                ck.narrow(2, start, t).copy_(&k);
                cv.narrow(2, start, t).copy_(&v);
                (ck.narrow(2, 0, start + t), cv.narrow(2, 0, start + t))
            }
            None => (k, v),
        };
        let gqa = nh != nkv;
        let y = match attend {
            Attend::Causal => Tensor::scaled_dot_product_attention(&q, &k, &v, None::<&Tensor>, 0.0, true, None, gqa),
            Attend::All => Tensor::scaled_dot_product_attention(&q, &k, &v, None::<&Tensor>, 0.0, false, None, gqa),
            Attend::Mask(m) => Tensor::scaled_dot_product_attention(&q, &k, &v, Some(m), 0.0, false, None, gqa),
        };
        y.transpose(1, 2).reshape([b, t, nh * hd]).matmul(&a.o.tr())
    }
}

/// Position of each token among the real tokens of its row: `cumsum(mask) − 1`, 0 on padding.
pub fn positions_from_mask(mask: &Tensor) -> Tensor {
    (mask.to_kind(Kind::Int64).cumsum(1, Kind::Int64) - 1).clamp_min(0)
}

/// `weight · x / sqrt(mean(x²) + eps)`, computed in f32 and cast back, as transformers does.
fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Tensor {
    let kind = x.kind();
    let x32 = x.to_kind(Kind::Float);
    let var = x32.square().mean_dim(-1, true, Kind::Float);
    w * (x32 * (var + eps).rsqrt()).to_kind(kind)
}

/// Inverse frequencies `θ^(−2i/hd)`, with the llama3 scaling when configured, computed with
/// the same float32 operations as transformers so that the angles agree to the last bit.
fn inv_freq(rope: &Rope, hd: i64, device: Device) -> Tensor {
    let exps = Tensor::arange_start_step(0, hd, 2, (Kind::Int64, Device::Cpu)).to_kind(Kind::Float) / (hd as f64);
    let mut f = Tensor::pow_scalar(rope.theta, &exps).reciprocal(); // [hd/2] f32
    if let Some(s) = &rope.llama3 {
        let old = s.original_max_position_embeddings;
        let (low_wavelen, high_wavelen) = (old / s.low_freq_factor, old / s.high_freq_factor);
        let wavelen = f.reciprocal() * (2.0 * std::f64::consts::PI);
        let scaled = (&f / s.factor).where_self(&wavelen.gt(low_wavelen), &f);
        let smooth = ((wavelen.reciprocal() * old) - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
        let smoothed = (smooth.ones_like() - &smooth) * &scaled / s.factor + &smooth * &scaled;
        let medium = wavelen.lt(high_wavelen).logical_not().logical_and(&wavelen.gt(low_wavelen).logical_not());
        f = smoothed.where_self(&medium, &scaled);
    }
    f.to_device(device)
}

/// `cos` and `sin` of the rotary angles for `positions [B, T]`, `[B, 1, T, hd]`, computed in f32
/// and cast to the model dtype.
fn rope_cos_sin(inv_freq: &Tensor, positions: &Tensor, kind: Kind) -> (Tensor, Tensor) {
    let freqs = positions.to_kind(Kind::Float).unsqueeze(-1) * inv_freq; // [B, T, hd/2]
    let emb = Tensor::cat(&[&freqs, &freqs], -1).unsqueeze(1); // [B, 1, T, hd]
    (emb.cos().to_kind(kind), emb.sin().to_kind(kind))
}

/// `x cos + rotate_half(x) sin`, `rotate_half([x1, x2]) = [−x2, x1]`.
fn apply_rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Tensor {
    let half = x.size()[3] / 2;
    let (x1, x2) = (x.narrow(3, 0, half), x.narrow(3, half, half));
    let rotated = Tensor::cat(&[&x2.neg(), &x1], 3);
    x * cos + rotated * sin
}
