//! The Llama decoder (`LlamaForCausalLM` of transformers), written out with tch: RMSNorm,
//! rotary embeddings (with the llama3 frequency scaling), grouped-query attention, SwiGLU.
//!
//! Shapes: `B` batch, `T` new tokens, `S` cached + new tokens, `H` hidden size, `nh` / `nkv`
//! query / key-value heads, `hd` head size, `V` vocabulary.

use crate::config::{LlamaConfig, Rope};
use crate::onednn::{self, PackedLinear};
use anyhow::Result;
use std::sync::{Arc, Mutex};
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
    kernels: Kernels,
    /// Whether generation on a CUDA device replays its decoding step as a CUDA graph.
    cuda_graphs: bool,
    /// The weights packed for generation and the stamps ([`onednn::stamp`]) of the weights they
    /// were made from: reused while no weight has changed.
    packed: Mutex<Option<PackedCopy>>,
}

/// Packed weights and the stamps of the weights they were made from.
type PackedCopy = (Vec<(usize, i64)>, Arc<Packed>);

/// The matrix products of the model: generation's (the cached forward of [`Llama::step`]) and
/// training's ([`Llama::hidden`], [`Llama::next_token_logits`], [`Llama::logits`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Kernels {
    /// libtorch's `matmul` (MKL's `sgemm` on the CPU) everywhere.
    #[value(help = "libtorch's matmul everywhere")]
    Plain,
    /// On the CPU in f32 or bf16, oneDNN ([`crate::onednn`]): generation on weights packed once
    /// per generation, about twice as fast at decoding shapes, at the cost of a packed copy of
    /// the weights while generating; training, for models of hidden size
    /// [`ONEDNN_TRAINING_MIN_HIDDEN`] or more, by [`onednn::train_linear`] (the products and the
    /// inputs' gradients by oneDNN, the weights' gradients by `mm`). The same products summed in
    /// another order (equal up to rounding). Elsewhere, where libtorch lacks oneDNN, or in bf16
    /// on a CPU whose bf16 oneDNN refuses ([`onednn::takes`]), [`Kernels::Plain`].
    #[value(help = "oneDNN's products on the CPU (generation; training at hidden size 512 or more)")]
    Onednn,
}

/// The smallest hidden size whose training products [`Kernels::Onednn`] computes with oneDNN.
/// Measured on 2 cores (docs/performance.md): at SmolLM2-135M's 576, oneDNN's products made a
/// training step 1.11 ± 0.02 times as fast as MKL's (alternating pairs in one process); at the
/// demo model's 128 about 6 % slower.
pub const ONEDNN_TRAINING_MIN_HIDDEN: i64 = 512;

/// Which keys each query attends to.
enum Attend {
    /// Key `j` for query `i` iff `j <= i` (no padding, no earlier cache).
    Causal,
    /// Every key (one new token, no padding in the cache).
    All,
    /// An explicit `[B, 1, T, S]` bool mask (padding present).
    Mask(Tensor),
    /// One new query per row over the slots of a decoding cache, where [`Attend::Ranges`] does
    /// not apply (a GPU; on the CPU [`Kernels::Plain`] or bf16): an additive `[B, 1, 1, S]` bias
    /// (0 where the row may see the key, −∞ elsewhere). Each group of query heads that shares a
    /// key head takes its scores in one product (`[g, hd] × [hd, S]`) and its output in another,
    /// reading each cached key and value once. SDPA's CPU kernel gave a slot's result last-bit
    /// differences that depended on the slot's position in the batch (on an AMD EPYC), which
    /// would make a completion depend on what ran beside it; these products do not (and are a
    /// few % faster). On a GPU, SDPA with a mask and fewer key heads than query heads falls to
    /// its math kernel, which copies the keys and values to f32 and to every query head (PyTorch
    /// 2.11: grouped-query attention works with the flash kernel, which takes no mask, and the
    /// math one), for Llama 3.2 1B's 32 query heads over 8 key heads about ten times the bf16
    /// cache's bytes written a step (the f32 copy, then four copies of it); these products read
    /// the cache once, in its own dtype (the scores of a bf16 model then round to bf16 before the
    /// softmax, as transformers' eager attention does).
    Slots(Tensor),
    /// One new query per row over the slots of a decoding cache, on the CPU in f32 with
    /// [`Kernels::Onednn`]: [`crate::attention::decode_attention`], row `s` seeing its cache
    /// positions `first[s]..=last[s]` (`[S]` each), and nothing else (the keys actually in use,
    /// where the other variants span the longest row's).
    Ranges { first: Tensor, last: Tensor },
}

/// The cache a forward pass writes its keys and values to.
enum Kv<'a> {
    /// None: the training forward.
    None,
    /// Appended after the cache's `len` positions, the same for every row.
    Append(&'a mut KvCache),
    /// One token per slot, written at the positions `index` (`[S, nkv, 1, hd]`) of each slot;
    /// attention reads positions `0..keys`.
    Slots { cache: &'a mut SlotCache, index: &'a Tensor, keys: i64 },
}

/// One layer's part of [`Kv`]: its key and value tensors and where the new ones go.
enum Write<'a> {
    Append(&'a mut Tensor, &'a mut Tensor, i64),
    Scatter(&'a mut Tensor, &'a mut Tensor, &'a Tensor, i64),
}

/// Keys and values of past tokens, preallocated for `capacity` positions, and the weights packed
/// for this generation when [`Kernels::Onednn`] applies.
pub struct KvCache {
    k: Vec<Tensor>, // per layer [B, nkv, capacity, hd]
    v: Vec<Tensor>,
    /// `[B, capacity]` bool: which cached positions hold real tokens (false for left padding).
    key_mask: Tensor,
    /// Number of positions written so far.
    pub len: i64,
    packed: Option<Arc<Packed>>,
}

impl KvCache {
    /// Rows held (the batch of the next [`Llama::step`]).
    pub fn rows(&self) -> i64 {
        self.key_mask.size()[0]
    }
}

/// Keys and values of `S` decoding slots, each with room for `capacity` positions, for the
/// fixed-shape decoding step [`Llama::decode`]: every slot holds one completion at its own length
/// (slot `s`'s real keys are positions `first[s]..=write[s]`), so that a finished slot can take a
/// new prompt while the others go on.
pub struct SlotCache {
    k: Vec<Tensor>, // per layer [S, nkv, capacity, hd]
    v: Vec<Tensor>,
    packed: Option<Arc<Packed>>,
}

impl SlotCache {
    /// Positions per slot.
    pub fn capacity(&self) -> i64 {
        self.k.first().map_or(0, |t| t.size()[2])
    }

    /// Copies rows `rows [J]` of a prefilled cache `from` (all its positions, `0..from.len`) into
    /// slots `slots [J]` (int64 on the cache's device), positions `0..from.len`.
    pub fn fill(&mut self, slots: &Tensor, from: &KvCache, rows: &Tensor) {
        let p = from.len;
        for (dst, src) in self.k.iter_mut().chain(self.v.iter_mut()).zip(from.k.iter().chain(from.v.iter())) {
            let _ = dst.narrow(2, 0, p).index_copy_(0, slots, &src.narrow(2, 0, p).index_select(0, rows));
        }
    }

    /// The cache of a smaller batch of `to` slots, in place: slot `from[i]` (at or past `to`)
    /// moves to slot `into[i]` (below `to`), its first `positions` positions copied; the slots
    /// below `to` that move nothing stay as they are, the slots from `to` on go. Only the moved
    /// slots are copied.
    pub fn compact(&mut self, from: &Tensor, into: &Tensor, to: i64, positions: i64) {
        for t in self.k.iter_mut().chain(self.v.iter_mut()) {
            let mut kept = t.narrow(2, 0, positions.min(t.size()[2]));
            let moved = kept.index_select(0, from);
            let _ = kept.index_copy_(0, into, &moved);
            *t = t.narrow(0, 0, to);
        }
    }

    /// Whether the products of a decoding step give every row the same bits in a batch of `rows`
    /// rows as in one of `of` rows, wherever the row stands in either ([`Packed::rows_agree`]):
    /// false without packed weights (libtorch's products promise nothing of the kind).
    pub fn rows_agree(&self, rows: i64, of: i64) -> Result<bool> {
        match &self.packed {
            Some(p) => p.rows_agree(rows, of),
            None => Ok(false),
        }
    }
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
        let kernels = Kernels::Onednn; // where it does not apply, generation uses `matmul`
        Ok(Self {
            cfg,
            vs,
            embed,
            layers,
            norm,
            lm_head,
            inv_freq,
            kind,
            kernels,
            cuda_graphs: false,
            packed: Mutex::new(None),
        })
    }

    pub fn kind(&self) -> Kind {
        self.kind
    }

    /// A copy of the model's weights as they are now, frozen (no gradient), with the same
    /// kernels: decoupled PPO's proximal policy recomputed from the model a run started with.
    pub fn frozen_copy(&self) -> Result<Llama> {
        let mut copy = Llama::new(self.cfg.clone(), self.device(), self.kind)?;
        copy.vs.copy(&self.vs)?;
        copy.vs.freeze();
        copy.kernels = self.kernels;
        Ok(copy)
    }

    pub fn device(&self) -> Device {
        self.vs.device()
    }

    /// The output projection `[V, H]` (for the fused log-prob path).
    pub fn lm_head(&self) -> &Tensor {
        &self.lm_head
    }

    /// The kernels chosen for generation (default [`Kernels::Onednn`]; whether they apply:
    /// [`Llama::packs_for_generation`]).
    pub fn kernels(&self) -> Kernels {
        self.kernels
    }

    /// Chooses the kernels of generation (see [`Kernels`]); [`Kernels::Plain`] frees the packed
    /// copy of the weights, if any.
    pub fn set_kernels(&mut self, kernels: Kernels) {
        self.kernels = kernels;
        if kernels == Kernels::Plain {
            *self.packed.lock().unwrap_or_else(|e| e.into_inner()) = None;
        }
    }

    /// Whether generation on a CUDA device records its decoding step as a CUDA graph, once per
    /// batch size and attended key count, and replays it ([`crate::cuda_graph`]; default false).
    /// Elsewhere it changes nothing.
    pub fn cuda_graphs(&self) -> bool {
        self.cuda_graphs
    }

    /// Chooses whether generation on a CUDA device replays CUDA graphs ([`Llama::cuda_graphs`]).
    pub fn set_cuda_graphs(&mut self, on: bool) {
        self.cuda_graphs = on;
    }

    /// Whether generation packs the weights for oneDNN: [`Kernels::Onednn`] chosen, on the CPU,
    /// in f32 or bf16, with a libtorch that has oneDNN, and for bf16 a CPU whose bf16 oneDNN
    /// takes ([`onednn::takes`]).
    pub fn packs_for_generation(&self) -> bool {
        self.uses_onednn()
    }

    /// Whether the training forward ([`Llama::hidden`], [`Llama::next_token_logits`],
    /// [`Llama::logits`]) multiplies with
    /// [`onednn::train_linear`]: as [`Llama::packs_for_generation`], for models of hidden size
    /// [`ONEDNN_TRAINING_MIN_HIDDEN`] or more.
    pub fn trains_with_onednn(&self) -> bool {
        self.uses_onednn() && self.cfg.hidden_size >= ONEDNN_TRAINING_MIN_HIDDEN
    }

    fn uses_onednn(&self) -> bool {
        self.kernels == Kernels::Onednn && self.device() == Device::Cpu && onednn::takes(self.kind)
    }

    /// The weights packed for generation (with [`Llama::packs_for_generation`]): packed on first
    /// use, kept with the model, and packed again when a weight has changed since (an optimiser
    /// step, a load), as the weights' version counters tell. The copy costs as much memory as
    /// the weights it packs; [`Llama::set_kernels`] with [`Kernels::Plain`] frees it.
    pub fn packed_weights(&self) -> Result<Option<Arc<Packed>>> {
        let mut slot = self.packed.lock().unwrap_or_else(|e| e.into_inner());
        if !self.packs_for_generation() {
            *slot = None;
            return Ok(None);
        }
        let stamps = self.weight_stamps();
        if let Some((old, p)) = slot.as_ref()
            && *old == stamps
        {
            return Ok(Some(p.clone()));
        }
        *slot = None; // the stale copy goes before the new one is made
        let p = Arc::new(tch::no_grad(|| Packed::new(self))?);
        *slot = Some((stamps, p.clone()));
        Ok(Some(p))
    }

    /// The stamps of every weight that [`Packed`] copies, in a fixed order.
    fn weight_stamps(&self) -> Vec<(usize, i64)> {
        let mut w: Vec<&Tensor> = vec![&self.lm_head];
        for l in &self.layers {
            w.extend([&l.attn.q, &l.attn.k, &l.attn.v, &l.attn.o, &l.mlp.gate, &l.mlp.up, &l.mlp.down]);
        }
        w.into_iter().map(onednn::stamp).collect()
    }

    /// A cache for `batch` rows and `capacity` positions; with [`Llama::packs_for_generation`],
    /// it also holds the packed weights ([`Llama::packed_weights`]).
    pub fn new_cache(&self, batch: i64, capacity: i64) -> Result<KvCache> {
        Ok(self.empty_cache(batch, capacity, self.packed_weights()?))
    }

    fn empty_cache(&self, batch: i64, capacity: i64, packed: Option<Arc<Packed>>) -> KvCache {
        let (nkv, hd) = (self.cfg.num_kv_heads(), self.cfg.head_dim());
        let opts = (self.kind, self.device());
        let mk = || (0..self.layers.len()).map(|_| Tensor::zeros([batch, nkv, capacity, hd], opts)).collect();
        KvCache {
            k: mk(),
            v: mk(),
            key_mask: Tensor::zeros([batch, capacity], (Kind::Bool, self.device())),
            len: 0,
            packed,
        }
    }

    /// Starts a generation: a cache for the `B` rows of `ids [B, P]` (left-padded, `mask [B, P]`
    /// true on real tokens) with room for `capacity` positions, holding the prompts, and the
    /// logits of each row's last position `[B, V]`. Rows with the same ids and mask (several
    /// samples of one prompt) are computed once and their keys and values copied: a batch of
    /// `k` samples per prompt pays one prompt's forward per prompt, not per row.
    pub fn prefill(&self, ids: &Tensor, mask: &Tensor, capacity: i64) -> Result<(KvCache, Tensor)> {
        let (b, p) = (ids.size()[0], ids.size()[1]);
        let mask = mask.to_kind(Kind::Bool);
        let key = Tensor::cat(&[ids.to_kind(Kind::Int64), mask.to_kind(Kind::Int64)], 1);
        let (unique, inverse, _) = key.unique_dim(0, false, true, false);
        let d = unique.size()[0];
        let mut cache = self.new_cache(b, capacity)?;
        if d == b {
            let logits = self.step(ids, &positions_from_mask(&mask), &mask, &mut cache)?;
            return Ok((cache, logits));
        }
        let (u_ids, u_mask) = (unique.narrow(1, 0, p), unique.narrow(1, p, p).to_kind(Kind::Bool));
        let mut shared = self.empty_cache(d, p, cache.packed.clone());
        let logits = self.step(&u_ids, &positions_from_mask(&u_mask), &u_mask, &mut shared)?;
        for (full, part) in cache.k.iter_mut().chain(cache.v.iter_mut()).zip(shared.k.iter().chain(shared.v.iter())) {
            full.narrow(2, 0, p).copy_(&part.index_select(0, &inverse));
        }
        cache.key_mask.narrow(1, 0, p).copy_(&shared.key_mask.index_select(0, &inverse));
        cache.len = p;
        Ok((cache, logits.index_select(0, &inverse)))
    }

    /// `S` empty decoding slots of `capacity` positions each (with [`Llama::packs_for_generation`],
    /// holding the packed weights).
    pub fn new_slots(&self, slots: i64, capacity: i64) -> Result<SlotCache> {
        // Keys and values of every layer, slot and position.
        let per_position = 2 * self.cfg.num_hidden_layers * self.cfg.num_kv_heads() * self.cfg.head_dim();
        let bytes = (slots.max(0) as u64)
            * (capacity.max(0) as u64)
            * (per_position as u64)
            * self.kind.elt_size_in_bytes() as u64;
        crate::memory::fits(
            self.device(),
            bytes,
            &format!("the KV cache of {slots} slot(s) × {capacity} positions ({} layers)", self.cfg.num_hidden_layers),
        )?;
        let cache = self.empty_cache(slots, capacity, self.packed_weights()?);
        Ok(SlotCache { k: cache.k, v: cache.v, packed: cache.packed })
    }

    /// The fixed-shape decoding step: feeds one token per slot, `ids [S]` at rotary positions
    /// `positions [S]`, writes its key and value at cache position `write [S]` of its slot, and
    /// attends to the slot's keys `first[s]..=write[s]` among positions `0..keys`; returns the
    /// logits `[S, V]`. Every shape depends on `S` and `keys` only, and nothing is read back to
    /// the host: the step can be replayed as a CUDA graph. `keys` must exceed every `write`
    /// (`cache.capacity()` always does).
    pub fn decode(
        &self,
        ids: &Tensor,
        positions: &Tensor,
        write: &Tensor,
        first: &Tensor,
        keys: i64,
        cache: &mut SlotCache,
    ) -> Result<Tensor> {
        let s = ids.size()[0];
        let (nkv, hd) = (self.cfg.num_kv_heads(), self.cfg.head_dim());
        let packed = cache.packed.clone();
        let allowed = || {
            let j = Tensor::arange(keys, (Kind::Int64, ids.device())).unsqueeze(0); // [1, keys]
            j.ge_tensor(&first.unsqueeze(1)).logical_and(&j.le_tensor(&write.unsqueeze(1))) // [S, keys]
        };
        let attend = if packed.is_some() && crate::attention::supports(ids.device(), self.kind) {
            Attend::Ranges { first: first.shallow_clone(), last: write.shallow_clone() }
        } else {
            let bias = Tensor::zeros([s, keys], (Kind::Float, ids.device()));
            Attend::Slots(bias.masked_fill(&allowed().logical_not(), f64::NEG_INFINITY).view([s, 1, 1, keys]))
        };
        let index = write.view([s, 1, 1, 1]).expand([s, nkv, 1, hd], false);
        let kv = Kv::Slots { cache, index: &index, keys };
        let (ids, positions) = (ids.view([s, 1]), positions.view([s, 1]));
        let h = match &packed {
            Some(p) => self.run(&ids, &positions, &attend, kv, p.as_ref())?,
            None => self.run(&ids, &positions, &attend, kv, &Plain)?,
        };
        let last = h.squeeze_dim(1);
        match &packed {
            Some(p) => p.lm_head.forward(&last),
            None => Ok(last.matmul(&self.lm_head.tr())),
        }
    }

    /// Final hidden states `[B, T, H]` (after the last RMSNorm) of a padded batch, without cache:
    /// the training forward. `mask [B, T]` is 1/true for real tokens; left or right padding both
    /// work (positions count real tokens only). The states at padding positions are unspecified
    /// (finite, but they depend on the padding); the real positions' do not. An error only if
    /// oneDNN fails ([`Kernels::Onednn`]).
    pub fn hidden(&self, ids: &Tensor, mask: &Tensor) -> Result<Tensor> {
        let mask = mask.to_kind(Kind::Bool);
        let positions = positions_from_mask(&mask);
        let t = ids.size()[1];
        // Without padding, or with padding only after each row's real tokens, plain causal
        // attention gives every real query exactly the keys it may see (the real tokens before
        // it), and lets libtorch use its fused causal kernel. Otherwise an explicit mask.
        let right_padded = t < 2
            || mask.narrow(1, 1, t - 1).logical_and(&mask.narrow(1, 0, t - 1).logical_not()).any().int64_value(&[])
                == 0;
        let attend = if right_padded {
            Attend::Causal
        } else {
            // allowed[b, 0, i, j] = j <= i and key j is real; every query may see itself.
            let causal = Tensor::ones([t, t], (Kind::Bool, ids.device())).tril(0);
            let allowed = causal
                .unsqueeze(0)
                .logical_and(&mask.unsqueeze(1))
                .logical_or(&Tensor::eye(t, (Kind::Bool, ids.device())));
            Attend::Mask(allowed.unsqueeze(1))
        };
        if self.trains_with_onednn() {
            self.run(ids, &positions, &attend, Kv::None, &TrainOnednn)
        } else {
            self.run(ids, &positions, &attend, Kv::None, &Plain)
        }
    }

    /// Logits `[B, T, V]` of a padded batch, every position's, in the model's dtype (training
    /// takes [`Llama::next_token_logits`], which skips the prompt's).
    pub fn logits(&self, ids: &Tensor, mask: &Tensor) -> Result<Tensor> {
        self.output(&self.hidden(ids, mask)?)
    }

    /// The next-token logits `[B, T − 1 − from, V]` at positions `from..T−1` of a padded batch
    /// `ids [B, T]`, each predicting the token after it: the training forward where the
    /// positions before `from` predict nothing that is trained (a prompt's). The layers see
    /// every position; only the output layer (and the log-softmax after it) skips the first
    /// `from`. Refused unless `0 ≤ from < T`.
    pub fn next_token_logits(&self, ids: &Tensor, mask: &Tensor, from: i64) -> Result<Tensor> {
        let t = ids.size().get(1).copied().unwrap_or(0);
        if !(0..t).contains(&from) {
            anyhow::bail!("next_token_logits: from = {from} is outside the batch's {t} positions");
        }
        self.output(&self.hidden(ids, mask)?.narrow(1, from, t - 1 - from).contiguous())
    }

    /// The output layer on hidden states `[…, H]` (no rows: an empty product, which oneDNN's
    /// training product is not given).
    fn output(&self, h: &Tensor) -> Result<Tensor> {
        if self.trains_with_onednn() && h.numel() > 0 {
            onednn::train_linear(h, &self.lm_head)
        } else {
            Ok(h.matmul(&self.lm_head.tr()))
        }
    }

    /// Feeds `ids [B, T]` at `positions [B, T]` through the model with a cache, marking them
    /// real where `new_mask [B, T]` is true; returns the logits of the last position `[B, V]`.
    /// Uses the cache's packed weights when it has them (an error only if oneDNN fails).
    pub fn step(&self, ids: &Tensor, positions: &Tensor, new_mask: &Tensor, cache: &mut KvCache) -> Result<Tensor> {
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
        let packed = cache.packed.clone();
        let h = match &packed {
            Some(p) => self.run(ids, positions, &attend, Kv::Append(cache), p.as_ref()),
            None => self.run(ids, positions, &attend, Kv::Append(cache), &Plain),
        };
        cache.len = total;
        let last = h?.narrow(1, t - 1, 1).squeeze_dim(1);
        match &packed {
            Some(p) => p.lm_head.forward(&last),
            None => Ok(last.matmul(&self.lm_head.tr())),
        }
    }

    // `x = x + …` on purpose: tch's `+=` adds in place, which would modify a tensor that the
    // autograd graph saved for the backward pass.
    #[allow(clippy::assign_op_pattern)]
    fn run<L: Linears>(
        &self,
        ids: &Tensor,
        positions: &Tensor,
        attend: &Attend,
        mut cache: Kv,
        lin: &L,
    ) -> Result<Tensor> {
        let (cos, sin) = rope_cos_sin(&self.inv_freq, positions, self.kind); // [B, 1, T, hd]
        let mut x = Tensor::embedding(&self.embed, ids, -1, false, false); // [B, T, H]
        for (l, layer) in self.layers.iter().enumerate() {
            let h = rms_norm(&x, &layer.input_norm, self.cfg.rms_norm_eps);
            let kv = match &mut cache {
                Kv::None => None,
                Kv::Append(c) => Some(Write::Append(&mut c.k[l], &mut c.v[l], c.len)),
                Kv::Slots { cache, index, keys } => {
                    Some(Write::Scatter(&mut cache.k[l], &mut cache.v[l], index, *keys))
                }
            };
            let (q, k, v) = lin.qkv(self, l, &h)?;
            let y = self.attention(&q, &k, &v, &cos, &sin, attend, kv)?;
            x = x + lin.o(self, l, &y)?;
            let h = rms_norm(&x, &layer.post_norm, self.cfg.rms_norm_eps);
            let (gate, up) = lin.gate_up(self, l, &h)?;
            x = x + lin.down(self, l, &(gate.silu() * up))?;
        }
        Ok(rms_norm(&x, &self.norm, self.cfg.rms_norm_eps))
    }

    /// Attention of the projected `q [B, T, nh·hd]`, `k`, `v [B, T, nkv·hd]` (rotary embedding
    /// applied here, keys and values appended to the cache): `[B, T, nh·hd]`, before `o_proj`.
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        attend: &Attend,
        cache: Option<Write>,
    ) -> Result<Tensor> {
        let (b, t) = (q.size()[0], q.size()[1]);
        let (nh, nkv, hd) = (self.cfg.num_attention_heads, self.cfg.num_kv_heads(), self.cfg.head_dim());
        let heads = |x: &Tensor, n: i64| x.reshape([b, t, n, hd]).transpose(1, 2); // [B, n, T, hd]
        let q = apply_rope(&heads(q, nh), cos, sin);
        let k = apply_rope(&heads(k, nkv), cos, sin);
        let v = heads(v, nkv);
        let (k, v) = match cache {
            Some(Write::Append(ck, cv, start)) => {
                ck.narrow(2, start, t).copy_(&k);
                cv.narrow(2, start, t).copy_(&v);
                (ck.narrow(2, 0, start + t), cv.narrow(2, 0, start + t))
            }
            Some(Write::Scatter(ck, cv, index, keys)) => {
                let _ = ck.scatter_(2, index, &k);
                let _ = cv.scatter_(2, index, &v);
                match attend {
                    // Each row reads its own range, which an idle row's may put past `keys`.
                    Attend::Ranges { .. } => (ck.shallow_clone(), cv.shallow_clone()),
                    _ => (ck.narrow(2, 0, keys), cv.narrow(2, 0, keys)),
                }
            }
            None => (k, v),
        };
        let gqa = nh != nkv;
        let y = match attend {
            Attend::Causal => Tensor::scaled_dot_product_attention(&q, &k, &v, None::<&Tensor>, 0.0, true, None, gqa),
            Attend::All => Tensor::scaled_dot_product_attention(&q, &k, &v, None::<&Tensor>, 0.0, false, None, gqa),
            Attend::Mask(m) => Tensor::scaled_dot_product_attention(&q, &k, &v, Some(m), 0.0, false, None, gqa),
            Attend::Slots(bias) => {
                let g = nh / nkv;
                let scores = q.reshape([b, nkv, g * t, hd]).matmul(&k.transpose(-1, -2)); // [B, nkv, g, S]
                let scores = scores * (1.0 / (hd as f64).sqrt()) + bias;
                scores.softmax(-1, Kind::Float).to_kind(v.kind()).matmul(&v).reshape([b, nh, t, hd])
            }
            Attend::Ranges { first, last } => crate::attention::decode_attention(&q, &k, &v, first, last)?,
        };
        Ok(y.transpose(1, 2).reshape([b, t, nh * hd]))
    }
}

/// The matrix products of a decoder layer, computed from the model's own weights ([`Plain`],
/// differentiable, the training path) or from a packed copy ([`Packed`], generation on the CPU).
trait Linears {
    /// `q [B, T, nh·hd]`, `k`, `v [B, T, nkv·hd]` of layer `l`'s normalised input `h`.
    fn qkv(&self, m: &Llama, l: usize, h: &Tensor) -> Result<(Tensor, Tensor, Tensor)>;
    /// `o_proj` of the attention output.
    fn o(&self, m: &Llama, l: usize, y: &Tensor) -> Result<Tensor>;
    /// `gate_proj(h)` and `up_proj(h)`.
    fn gate_up(&self, m: &Llama, l: usize, h: &Tensor) -> Result<(Tensor, Tensor)>;
    /// `down_proj` of the gated product.
    fn down(&self, m: &Llama, l: usize, x: &Tensor) -> Result<Tensor>;
}

/// `x · Wᵀ` with libtorch's `matmul` on the model's weights.
struct Plain;

impl Linears for Plain {
    fn qkv(&self, m: &Llama, l: usize, h: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
        let a = &m.layers[l].attn;
        Ok((h.matmul(&a.q.tr()), h.matmul(&a.k.tr()), h.matmul(&a.v.tr())))
    }
    fn o(&self, m: &Llama, l: usize, y: &Tensor) -> Result<Tensor> {
        Ok(y.matmul(&m.layers[l].attn.o.tr()))
    }
    fn gate_up(&self, m: &Llama, l: usize, h: &Tensor) -> Result<(Tensor, Tensor)> {
        let f = &m.layers[l].mlp;
        Ok((h.matmul(&f.gate.tr()), h.matmul(&f.up.tr())))
    }
    fn down(&self, m: &Llama, l: usize, x: &Tensor) -> Result<Tensor> {
        Ok(x.matmul(&m.layers[l].mlp.down.tr()))
    }
}

/// `x · Wᵀ` by [`onednn::train_linear`] on the model's weights: differentiable, the training
/// path under [`Kernels::Onednn`].
struct TrainOnednn;

impl Linears for TrainOnednn {
    fn qkv(&self, m: &Llama, l: usize, h: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
        let a = &m.layers[l].attn;
        Ok((onednn::train_linear(h, &a.q)?, onednn::train_linear(h, &a.k)?, onednn::train_linear(h, &a.v)?))
    }
    fn o(&self, m: &Llama, l: usize, y: &Tensor) -> Result<Tensor> {
        onednn::train_linear(y, &m.layers[l].attn.o)
    }
    fn gate_up(&self, m: &Llama, l: usize, h: &Tensor) -> Result<(Tensor, Tensor)> {
        let f = &m.layers[l].mlp;
        Ok((onednn::train_linear(h, &f.gate)?, onednn::train_linear(h, &f.up)?))
    }
    fn down(&self, m: &Llama, l: usize, x: &Tensor) -> Result<Tensor> {
        onednn::train_linear(x, &m.layers[l].mlp.down)
    }
}

/// One layer's weights packed for oneDNN, `q|k|v` and `gate|up` stacked into one product each.
struct PackedLayer {
    qkv: PackedLinear,
    o: PackedLinear,
    gate_up: PackedLinear,
    down: PackedLinear,
}

/// The model's weights packed for oneDNN ([`crate::onednn`]): a copy, made and refreshed by
/// [`Llama::packed_weights`].
pub struct Packed {
    layers: Vec<PackedLayer>,
    lm_head: PackedLinear,
    /// [`Packed::rows_agree`]'s last full batch and its answers.
    probe: Mutex<Option<Probe>>,
}

/// A full batch of [`Packed::rows_agree`]: its row count `of`, each shape's input rows and their
/// products, and the answers found so far, by smaller row count.
struct Probe {
    of: i64,
    full: Vec<(Tensor, Tensor)>,
    agree: std::collections::HashMap<i64, bool>,
}

// SAFETY: a `Packed`'s weights are written once, when made, and only read afterwards (oneDNN
// reads the packed weights; libtorch's reference counts are atomic), and its probe's tensors are
// touched only under their mutex, so sharing it between threads is sound; tch's `Tensor` is not
// `Sync` only because its methods can write in place.
unsafe impl Sync for Packed {}

impl Packed {
    fn new(m: &Llama) -> anyhow::Result<Self> {
        let layers = m
            .layers
            .iter()
            .map(|layer| {
                let (a, f) = (&layer.attn, &layer.mlp);
                Ok(PackedLayer {
                    qkv: PackedLinear::new(&Tensor::cat(&[&a.q, &a.k, &a.v], 0))?,
                    o: PackedLinear::new(&a.o)?,
                    gate_up: PackedLinear::new(&Tensor::cat(&[&f.gate, &f.up], 0))?,
                    down: PackedLinear::new(&f.down)?,
                })
            })
            .collect::<anyhow::Result<_>>()?;
        Ok(Self { layers, lm_head: PackedLinear::new(&m.lm_head)?, probe: Mutex::default() })
    }

    /// Whether every product of the decoding step gives a row the same bits in a batch of `rows`
    /// rows as in one of `of` rows, wherever the row stands in either. oneDNN promises nothing of
    /// the kind, and whether it holds depends on the CPU and on the sizes (its kernels and their
    /// blocking are chosen per shape; one CPU measured gave different bits at one row only): so
    /// it is tried on each shape the step multiplies by (every layer has the same ones), with
    /// `of` fixed pseudo-random rows against `rows` of them taken in reverse order. The full
    /// batch's products and the answers are kept while the same `of` is asked: a size then costs
    /// the products of its own `rows` rows, once.
    pub fn rows_agree(&self, rows: i64, of: i64) -> Result<bool> {
        if rows < 1 || rows > of {
            return Ok(rows == of);
        }
        let mut probe = self.probe.lock().unwrap_or_else(|e| e.into_inner());
        let p = match probe.take() {
            Some(p) if p.of == of => probe.insert(p),
            _ => probe.insert(tch::no_grad(|| self.full_batch(of))?),
        };
        if let Some(&known) = p.agree.get(&rows) {
            return Ok(known);
        }
        // The small batch: rows of-1 down to of-rows of the large one (every row moves).
        let back = Tensor::arange_start_step(of - 1, of - 1 - rows, -1, (Kind::Int64, Device::Cpu));
        let mut agree = true;
        for (lin, (x, all)) in self.shapes().into_iter().zip(&p.full) {
            let some = tch::no_grad(|| lin.forward(&x.index_select(0, &back)))?;
            if !some.equal(&all.index_select(0, &back)) {
                agree = false;
                break;
            }
        }
        p.agree.insert(rows, agree);
        Ok(agree)
    }

    /// One of each product shape of the decoding step (every layer has the same ones).
    fn shapes(&self) -> Vec<&PackedLinear> {
        let mut shapes = vec![&self.lm_head];
        if let Some(l) = self.layers.first() {
            shapes.extend([&l.qkv, &l.o, &l.gate_up, &l.down]);
        }
        shapes
    }

    /// The probe's full batch: `of` fixed pseudo-random rows through each shape.
    fn full_batch(&self, of: i64) -> Result<Probe> {
        let full = self
            .shapes()
            .into_iter()
            .map(|lin| {
                let k = lin.in_features();
                let x = (Tensor::arange(of * k, (Kind::Float, Device::Cpu)) * 0.618_034).sin().view([of, k]);
                let x = x.to_kind(lin.kind());
                let y = lin.forward(&x)?;
                Ok((x, y))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Probe { of, full, agree: Default::default() })
    }
}

impl Linears for Packed {
    fn qkv(&self, m: &Llama, l: usize, h: &Tensor) -> anyhow::Result<(Tensor, Tensor, Tensor)> {
        let (q, kv) = (m.cfg.num_attention_heads * m.cfg.head_dim(), m.cfg.num_kv_heads() * m.cfg.head_dim());
        let y = self.layers[l].qkv.forward(h)?;
        Ok((y.narrow(-1, 0, q), y.narrow(-1, q, kv), y.narrow(-1, q + kv, kv)))
    }
    fn o(&self, _: &Llama, l: usize, y: &Tensor) -> anyhow::Result<Tensor> {
        self.layers[l].o.forward(y)
    }
    fn gate_up(&self, m: &Llama, l: usize, h: &Tensor) -> anyhow::Result<(Tensor, Tensor)> {
        let i = m.cfg.intermediate_size;
        let y = self.layers[l].gate_up.forward(h)?;
        Ok((y.narrow(-1, 0, i), y.narrow(-1, i, i)))
    }
    fn down(&self, _: &Llama, l: usize, x: &Tensor) -> anyhow::Result<Tensor> {
        self.layers[l].down.forward(x)
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
    // As transformers computes them (the same elements in the same vectorised passes); then the
    // sine's first half negated once here, for every layer: see `apply_rope`.
    let sin = emb.sin();
    let half = sin.size()[3] / 2;
    let sin = Tensor::cat(&[&sin.narrow(3, 0, half).neg(), &sin.narrow(3, half, half)], 3);
    (emb.cos().to_kind(kind), sin.to_kind(kind))
}

/// `x cos + rotate_half(x) sin`, `rotate_half([x1, x2]) = [−x2, x1]`, given `sin` with its first
/// half negated (`rope_cos_sin`): `[x2, x1] · [−sin₁, sin₂]`, the same bits as `[−x2, x1] · sin`
/// (a product's sign is exact) without a negation of `x` in every layer.
fn apply_rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Tensor {
    let half = x.size()[3] / 2;
    let (x1, x2) = (x.narrow(3, 0, half), x.narrow(3, half, half));
    x * cos + Tensor::cat(&[&x2, &x1], 3) * sin
}
