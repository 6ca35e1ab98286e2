//! Generation with continuous batching over a fixed-shape decoding state: a cache of `S` slots,
//! each holding one completion at its own length; an ended completion's slot takes the next
//! prompt at once ([`run`], [`Batching`]). Greedy, temperature, top-k and top-p sampling, each
//! completion drawing from its own random stream ([`Stream`]).
//!
//! For every sampled token it records two log-probabilities: under the model itself
//! (temperature 1, no truncation) and under the distribution actually sampled from (after
//! temperature, top-k and top-p), so that either can serve as μ for an off-policy loss.

use crate::cuda_graph::{CudaGraph, GraphPool};
use crate::model::{KvCache, Llama, SlotCache};
use anyhow::{Result, bail};
use tch::{Kind, Tensor};

/// The sampling distribution: temperature, then top-k, then top-p.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub struct SamplingParams {
    pub temperature: f64,
    pub top_p: f64,
    /// 0 disables top-k.
    pub top_k: i64,
}

impl Default for SamplingParams {
    /// Temperature 1, no truncation: the model's own distribution.
    fn default() -> Self {
        Self { temperature: 1.0, top_p: 1.0, top_k: 0 }
    }
}

impl SamplingParams {
    pub fn check(&self) -> Result<()> {
        if !(self.temperature.is_finite() && self.temperature > 0.0) {
            bail!("the temperature must be > 0 (greedy decoding takes the argmax), got {}", self.temperature);
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            bail!("top-p must lie in (0, 1], got {}", self.top_p);
        }
        if self.top_k < 0 {
            bail!("top-k must be >= 0 (0 disables it), got {}", self.top_k);
        }
        Ok(())
    }
}

/// How the next token is chosen.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Decoding {
    /// The most likely token.
    Greedy,
    /// A draw from the sampling distribution.
    Sample(SamplingParams),
}

/// Generation settings: the decoding and the token budget.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub struct Sampling {
    pub decoding: Decoding,
    pub max_new_tokens: i64,
}

impl Sampling {
    /// Greedy decoding of at most `max_new_tokens` tokens.
    pub fn greedy(max_new_tokens: i64) -> Self {
        Self { decoding: Decoding::Greedy, max_new_tokens }
    }

    /// Sampling from `params`, at most `max_new_tokens` tokens.
    pub fn sample(params: SamplingParams, max_new_tokens: i64) -> Self {
        Self { decoding: Decoding::Sample(params), max_new_tokens }
    }

    pub fn check(&self) -> Result<()> {
        if let Decoding::Sample(p) = &self.decoding {
            p.check()?;
        }
        if self.max_new_tokens < 1 {
            bail!("the token budget (max new tokens) must be >= 1, got {}", self.max_new_tokens);
        }
        Ok(())
    }
}

/// Why a row stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Stop {
    Eos,
    Length,
}

/// One generated completion.
#[derive(Debug, Clone)]
pub struct Completion {
    /// Generated ids, the end-of-sequence token included when it was produced.
    pub tokens: Vec<i64>,
    /// `log π(token)` under the model at temperature 1.
    pub logp_model: Vec<f32>,
    /// `log q(token)` under the sampling distribution (0 for greedy decoding).
    pub logp_sampling: Vec<f32>,
    pub stop: Stop,
}

/// Applies temperature, top-k and top-p (in that order, as transformers' logits processors) to
/// `logits [B, V]` (f32), masking removed tokens with −inf.
pub fn sampling_logits(logits: &Tensor, s: &SamplingParams) -> Tensor {
    let mut z = logits / s.temperature;
    let v = z.size()[1];
    if s.top_k > 0 && s.top_k < v {
        let (top, _) = z.topk(s.top_k, -1, true, true);
        let kth = top.narrow(1, s.top_k - 1, 1); // [B, 1]
        z = z.masked_fill(&z.lt_tensor(&kth), f64::NEG_INFINITY);
    }
    if s.top_p < 1.0 {
        // transformers' TopPLogitsWarper: ascending sort, drop the tokens whose cumulative
        // probability stays <= 1 − p, always keep the most likely one.
        let (sorted, idx) = z.sort(-1, false);
        let cum = sorted.softmax(-1, Kind::Float).cumsum(-1, Kind::Float);
        let remove = cum.le(1.0 - s.top_p);
        let _ = remove.narrow(1, v - 1, 1).fill_(0);
        let remove = remove.zeros_like().scatter(1, &idx, &remove);
        z = z.masked_fill(&remove, f64::NEG_INFINITY);
    }
    z
}

/// The random stream of one completion: a 64-bit key from which every draw of that completion
/// is computed ([`uniform`]), so that its draws depend on the key alone — not on the slot it took,
/// what ran beside it, or when it started.
///
/// `Stream::new(seed, prompt, sample)` is the stream of sample `sample` of the prompt at index
/// `prompt` of a run seeded with `seed` (SplitMix64 of each part in turn, Steele et al. 2014).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Stream(pub u64);

impl Stream {
    pub fn new(seed: u64, prompt: u64, sample: u64) -> Self {
        Self(splitmix64(splitmix64(splitmix64(seed) ^ prompt) ^ sample))
    }
}

/// SplitMix64's output function of `x + γ` (Steele, Lea and Flood 2014).
fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The 32-bit mixer "lowbias32" (C. Wellons, hash-prospector): the hash that [`uniform`] applies
/// on the device, here on one value.
pub fn mix32(mut x: u32) -> u32 {
    x ^= x >> 16;
    x = x.wrapping_mul(0x7feb_352d);
    x ^= x >> 15;
    x = x.wrapping_mul(0x846c_a68b);
    x ^ (x >> 16)
}

/// Draw `step` of stream `key` (the `step`-th token of a completion), uniform on `[0, 1)` with
/// 52 random bits: two words of [`mix32`] hashes of the key's halves and the step. The device
/// computes the same numbers ([`uniform_tensor`]); this is the scalar reference.
pub fn uniform(key: Stream, step: u32) -> f64 {
    let (hi, lo) = ((key.0 >> 32) as u32, key.0 as u32);
    let a = mix32(hi ^ mix32(lo ^ mix32(step)));
    let b = mix32(a ^ 0x9e37_79b9);
    (f64::from(a >> 6) * 67_108_864.0 + f64::from(b >> 6)) / 4_503_599_627_370_496.0
}

/// `x · c mod 2³²` for `x [..]` int64 holding values in `0..2³²`, without overflowing int64
/// (`c` in two 16-bit halves).
fn mul32(x: &Tensor, c: u32) -> Tensor {
    let (lo, hi) = (i64::from(c & 0xffff), i64::from(c >> 16));
    ((x * lo) + (((x * hi).bitwise_and(0xffff)) * 65_536)).bitwise_and(0xffff_ffff)
}

fn mix32_tensor(x: &Tensor) -> Tensor {
    let x = x.bitwise_xor_tensor(&x.bitwise_right_shift_tensor_scalar(16));
    let x = mul32(&x, 0x7feb_352d);
    let x = x.bitwise_xor_tensor(&x.bitwise_right_shift_tensor_scalar(15));
    let x = mul32(&x, 0x846c_a68b);
    x.bitwise_xor_tensor(&x.bitwise_right_shift_tensor_scalar(16))
}

/// [`uniform`] on the device: `hi`, `lo` (int64, the keys' halves) and `step` (int64), all `[S]`;
/// returns `[S]` f64. Integer operations only, so every device computes the same bits.
pub fn uniform_tensor(hi: &Tensor, lo: &Tensor, step: &Tensor) -> Tensor {
    let a = mix32_tensor(&hi.bitwise_xor_tensor(&mix32_tensor(&lo.bitwise_xor_tensor(&mix32_tensor(step)))));
    let b = mix32_tensor(&a.bitwise_xor(0x9e37_79b9_i64));
    (a.bitwise_right_shift_tensor_scalar(6).to_kind(Kind::Double) * 67_108_864.0
        + b.bitwise_right_shift_tensor_scalar(6).to_kind(Kind::Double))
        / 4_503_599_627_370_496.0
}

/// Draws one token per row of the log-probabilities `logq [S, V]` (f32) by inversion, with the
/// uniform numbers `u [S]` (f64, in `[0, 1)`): the first token whose cumulative probability (in
/// f64) exceeds `u` times the total. A token of probability 0 is never drawn; shapes are fixed
/// and nothing is read back.
pub fn draw(logq: &Tensor, u: &Tensor) -> Tensor {
    let cdf = logq.exp().cumsum(-1, Kind::Double); // [S, V]
    let v = cdf.size()[1];
    let target = (u * cdf.narrow(1, v - 1, 1).squeeze_dim(1)).unsqueeze(1); // [S, 1]
    target.searchsorted(&cdf, false, true, "right", None::<Tensor>).squeeze_dim(1).clamp_max(v - 1)
}

/// One completion to generate: the prompt (an index into the prompts) and its random stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Job {
    pub prompt: usize,
    pub stream: Stream,
}

/// How [`run`] batches its jobs.
///
/// Generation keeps `slots` completions in flight. A slot whose completion has ended (an
/// end-of-sequence token, or the budget) takes the next job at once — its prompt prefilled into
/// that slot — so the batch stays full until the jobs run out (continuous batching). The host reads which
/// slots have ended (with their tokens, and whether any logits were not finite) once every
/// `sync_every` steps, and whenever a completion must have reached its budget; between those
/// reads the decoding steps run on the device without waiting for the host. A slot that ended
/// since the last read computes (and discards) at most `sync_every − 1` more tokens.
///
/// What a completion is depends on its prompt, its [`Stream`], the slot count and the longest
/// prompt given (the capacity), to the bit: every step runs on the same shapes, every row on its
/// own. `sync_every` and `refill` change nothing. The slot count changes only rounding (the
/// matrix libraries sum a product's terms in an order that depends on its number of rows), which
/// can flip a draw that falls within it of a boundary between two tokens: rarely, but a run that
/// must reproduce another keeps its slots (`sample` records them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Batching {
    /// Completions in flight (0: every job at once).
    pub slots: usize,
    /// Steps between the host's reads (0: [`Batching::default_sync`] of the model's device).
    pub sync_every: usize,
    /// Whether an ended completion's slot takes the next job at once (true: continuous
    /// batching). False gives the draining batches of earlier versions — the next `slots` jobs
    /// start only once every slot has ended — for comparison.
    pub refill: bool,
    /// Whether the batch sheds its empty slots once the jobs have run out ([`Shrink`]; default
    /// [`Shrink::WhenExact`]).
    pub shrink: Shrink,
}

/// What [`run`] does with the slots that empty once no job is left to take them. The work of a
/// decoding step grows with its rows, empty or not: on one CPU thread, with 128 completions of
/// uneven lengths on 64 slots, about a sixth of the rows computed were empty ones.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shrink {
    /// The batch keeps its rows to the end: every step on the same shapes.
    Never,
    /// The running slots move into a smaller batch, as [`Shrink::Always`], but only where that
    /// changes no bit: where the step's matrix products give every row the same bits at the
    /// smaller size as at the full one ([`SlotCache::rows_agree`], tried once per size; on the
    /// CPU with the packed weights). Elsewhere (on a GPU, with the plain kernels) as
    /// [`Shrink::Never`]. A resumed or sharded run then still reproduces an uninterrupted one.
    WhenExact,
    /// Once the jobs have run out, the running slots move into a smaller batch after every
    /// collection: the next multiple of [`SHRINK_ROWS`] rows that holds them (with CUDA graphs,
    /// half the batch, repeatedly, while they fit: one recording per size). The products' rounding
    /// may then change with the batch size, and a resumed or sharded run may draw differently
    /// from an uninterrupted one where a draw falls within that rounding of a boundary.
    Always,
}

/// The sizes a shrinking batch takes: multiples of this many rows (or the full batch).
pub const SHRINK_ROWS: usize = 8;

impl Default for Batching {
    /// Every job at once, the device's default reads, continuous batching, shrinking where exact.
    fn default() -> Self {
        Self { slots: 0, sync_every: 0, refill: true, shrink: Shrink::WhenExact }
    }
}

impl Batching {
    /// `slots` completions in flight, the device's default reads.
    pub fn slots(slots: usize) -> Self {
        Self { slots, ..Self::default() }
    }

    /// Steps between the host's reads on `device` when [`Batching::sync_every`] is 0: every step
    /// on the CPU (a read there costs no transfer, and a finished slot is refilled at once), 16 on
    /// a GPU (where each read stalls the stream of kernels).
    pub fn default_sync(device: tch::Device) -> usize {
        if device == tch::Device::Cpu { 1 } else { 16 }
    }
}

/// Generates one completion per prompt (ids), every prompt in one batch; completion `i` draws
/// from `Stream::new(seed, i, 0)` (greedy decoding draws nothing).
pub fn generate(model: &Llama, prompts: &[Vec<i64>], s: &Sampling, eos: &[i64], seed: u64) -> Result<Vec<Completion>> {
    let jobs: Vec<Job> =
        (0..prompts.len()).map(|i| Job { prompt: i, stream: Stream::new(seed, i as u64, 0) }).collect();
    collect(model, prompts, &jobs, s, eos, Batching::default(), || ())
}

/// [`run`], the completions returned in the order of `jobs`; `each()` is called as each ends
/// (a progress bar's tick).
pub fn collect(
    model: &Llama,
    prompts: &[Vec<i64>],
    jobs: &[Job],
    s: &Sampling,
    eos: &[i64],
    batching: Batching,
    mut each: impl FnMut(),
) -> Result<Vec<Completion>> {
    let mut out: Vec<Option<Completion>> = vec![None; jobs.len()];
    run(model, prompts, jobs, s, eos, batching, |j, c| {
        out[j] = Some(c);
        each();
        Ok(())
    })?;
    out.into_iter().map(|c| c.ok_or_else(|| anyhow::anyhow!("a job ended without its completion"))).collect()
}

/// Generates a completion for every job, `batching.slots` at a time with continuous batching
/// (see [`Batching`]), calling `done(j, completion)` as job `j` ends — in the order they end,
/// not the order of `jobs`. Every prompt needs at least one token, and the longest prompt plus
/// the budget must fit the model's context: the cache of every slot holds that many positions,
/// the longest of all `prompts`, not only of the jobs' (pass every prompt of a task, so that a
/// run of part of it decodes on the same shapes as a run of all of it).
pub fn run(
    model: &Llama,
    prompts: &[Vec<i64>],
    jobs: &[Job],
    s: &Sampling,
    eos: &[i64],
    batching: Batching,
    mut done: impl FnMut(usize, Completion) -> Result<()>,
) -> Result<()> {
    s.check()?;
    if prompts.iter().any(|p| p.is_empty()) {
        bail!("every prompt needs at least one token");
    }
    if let Some(j) = jobs.iter().find(|j| j.prompt >= prompts.len()) {
        bail!("a job names prompt {} of {}", j.prompt, prompts.len());
    }
    for p in prompts {
        check_ids(p, model.cfg.vocab_size, "a prompt")?;
    }
    if jobs.is_empty() {
        return Ok(());
    }
    // The capacity from every prompt given, not only the jobs': a run of part of the same prompts
    // (a resumed or sharded one) then decodes on the same shapes.
    let p_max = prompts.iter().map(Vec::len).max().unwrap_or(0) as i64;
    let limit = model.cfg.max_position_embeddings;
    if p_max + s.max_new_tokens > limit {
        bail!("prompt ({p_max} tokens) + max new tokens ({}) exceeds the model's context of {limit}", s.max_new_tokens);
    }
    let slots = if batching.slots == 0 { jobs.len() } else { batching.slots };
    let sync = if batching.sync_every == 0 { Batching::default_sync(model.device()) } else { batching.sync_every };
    tch::no_grad(|| {
        let capacity = whole_blocks(p_max + s.max_new_tokens);
        let mut d = Decoder::new(model, s, eos, slots as i64, capacity)?;
        let mut next_job = 0;
        let mut steps = 0usize;
        loop {
            let must = d.occupied.iter().flatten().any(|o| o.steps >= s.max_new_tokens);
            if steps % sync == 0 || must || d.occupied.iter().all(Option::is_none) {
                for (j, c) in d.collect()? {
                    done(j, c)?;
                }
                let free: Vec<usize> = (0..d.occupied.len()).filter(|&i| d.occupied[i].is_none()).collect();
                let drained = batching.refill || free.len() == d.occupied.len();
                let take = if drained { free.len().min(jobs.len() - next_job) } else { 0 };
                if take > 0 {
                    let (now, upcoming) = jobs[next_job..].split_at(take);
                    d.fill(prompts, &free[..take], now, next_job, upcoming)?;
                    next_job += take;
                }
                if d.occupied.iter().all(Option::is_none) {
                    return Ok(());
                }
                if next_job == jobs.len() {
                    d.shrink(batching.shrink)?;
                }
            }
            d.step()?;
            steps += 1;
        }
    })
}

/// Attention reads the keys in whole blocks of this many positions: the eager step attends to the
/// blocks that hold any slot's keys, not to the whole capacity, and a slot's result does not
/// depend on how many blocks are read (its keys lie in the same places of every block; past its
/// keys the blocks are masked).
pub const KEY_BLOCK: i64 = 64;

/// `n` rounded up to whole [`KEY_BLOCK`]s.
fn whole_blocks(n: i64) -> i64 {
    (n + KEY_BLOCK - 1) / KEY_BLOCK * KEY_BLOCK
}

/// The CUDA graphs recorded at one batch size, by the key count they attend to: the
/// [`GRAPHS_KEPT`] used last (another is recorded again when needed), and the key counts that
/// have had their eager warm-up step. Generic over the graph, for tests on machines without one.
struct Graphs<G> {
    /// Most recently used last.
    kept: Vec<(i64, G)>,
    warmed: Vec<i64>,
    /// The memory pool they all record into (made at the first recording): a step allocates
    /// nothing that outlives it, and they replay one at a time.
    pool: Option<GraphPool>,
}

/// CUDA graphs kept per batch size: as completions grow, the key count moves up a block every
/// [`KEY_BLOCK`] steps, and back down when the longest completion ends. They share one memory
/// pool for the step's intermediate tensors (the logits and their softmax, `[S, V]` each); each
/// is a recorded launch sequence of its own.
const GRAPHS_KEPT: usize = 4;

impl<G> Default for Graphs<G> {
    fn default() -> Self {
        Self { kept: vec![], warmed: vec![], pool: None }
    }
}

impl<G> Graphs<G> {
    /// The graph of `keys`, marked as the most recently used.
    fn get(&mut self, keys: i64) -> Option<&G> {
        let at = self.kept.iter().position(|(k, _)| *k == keys)?;
        let entry = self.kept.remove(at);
        self.kept.push(entry);
        self.kept.last().map(|(_, g)| g)
    }

    /// Whether `keys` is seen for the first time (its step then runs eagerly, as the warm-up).
    fn first_visit(&mut self, keys: i64) -> bool {
        if self.warmed.contains(&keys) {
            return false;
        }
        self.warmed.push(keys);
        true
    }

    /// Keeps `g` for `keys`, dropping the least recently used graph beyond [`GRAPHS_KEPT`].
    fn insert(&mut self, keys: i64, g: G) {
        self.kept.retain(|(k, _)| *k != keys);
        self.kept.push((keys, g));
        if self.kept.len() > GRAPHS_KEPT {
            self.kept.remove(0);
        }
    }
}

/// What the host knows of an occupied slot without reading the device.
#[derive(Debug, Clone, Copy)]
struct Occupant {
    job: usize,
    /// Decoding steps run since the slot was filled: an upper bound of its tokens.
    steps: i64,
    /// The cache position of its first generated token.
    start: i64,
}

/// The fixed-shape decoding state of [`run`]: per-slot tensors on the model's device, and the
/// host's view of which slot holds which job.
struct Decoder<'a> {
    model: &'a Llama,
    s: Sampling,
    cache: SlotCache,
    eos: Tensor,
    eos_ids: Vec<i64>,
    /// `[S, V]` f32: the logits the next token of each slot is drawn from.
    logits: Tensor,
    /// `[S]` int64: the rotary position, the cache position and the first real key of the
    /// slot's next input token; tokens generated; the stream key's halves; 1 + the first
    /// generated token whose logits were not finite (0: none).
    pos: Tensor,
    write: Tensor,
    first: Tensor,
    len: Tensor,
    hi: Tensor,
    lo: Tensor,
    bad: Tensor,
    /// `[S]` bool: ended (or empty).
    ended: Tensor,
    /// `[S, budget + 1]`: tokens and their two log-probs, by position in the completion.
    tokens: Tensor,
    lp: Tensor,
    lq: Tensor,
    occupied: Vec<Option<Occupant>>,
    /// The slots it started with (a shrunk batch has fewer).
    full: i64,
    /// Whether steps replay CUDA graphs ([`Llama::cuda_graphs`] on a CUDA device), and those of
    /// the current batch size.
    graphs: bool,
    recorded: Graphs<CudaGraph>,
    /// Prefills kept for jobs still to start: prompt → its cache (one row) and last logits.
    prefixes: std::collections::HashMap<Vec<i64>, (KvCache, Tensor)>,
}

impl<'a> Decoder<'a> {
    fn new(model: &'a Llama, s: &Sampling, eos: &[i64], slots: i64, capacity: i64) -> Result<Self> {
        let dev = model.device();
        let int = |v: i64| Tensor::full([slots], v, (Kind::Int64, dev));
        let row = |kind| Tensor::zeros([slots, s.max_new_tokens + 1], (kind, dev));
        Ok(Self {
            model,
            s: *s,
            cache: model.new_slots(slots, capacity)?,
            eos: Tensor::from_slice(eos).to_device(dev),
            eos_ids: eos.to_vec(),
            logits: Tensor::zeros([slots, model.cfg.vocab_size], (Kind::Float, dev)),
            pos: int(0),
            write: int(0),
            first: int(0),
            len: int(0),
            hi: int(0),
            lo: int(0),
            bad: int(0),
            ended: Tensor::ones([slots], (Kind::Bool, dev)),
            tokens: row(Kind::Int64),
            lp: row(Kind::Float),
            lq: row(Kind::Float),
            occupied: vec![None; slots as usize],
            full: slots,
            graphs: model.cuda_graphs() && dev.is_cuda(),
            recorded: Graphs::default(),
            prefixes: std::collections::HashMap::new(),
        })
    }

    /// Reads the ended slots (one read of the flags, one of their rows), frees them and returns
    /// their completions; refuses non-finite logits.
    fn collect(&mut self) -> Result<Vec<(usize, Completion)>> {
        let s = self.occupied.len();
        let flags = Vec::<i64>::try_from(
            Tensor::cat(&[self.ended.to_kind(Kind::Int64), self.bad.shallow_clone()], 0).to_device(tch::Device::Cpu),
        )?;
        let (ended, bad) = flags.split_at(s);
        if let Some(&b) = (0..s).filter(|&i| self.occupied[i].is_some()).map(|i| &bad[i]).find(|&&b| b > 0) {
            bail!("{}", non_finite_logits(b - 1));
        }
        let rows: Vec<usize> = (0..s).filter(|&i| self.occupied[i].is_some() && ended[i] == 1).collect();
        if rows.is_empty() {
            return Ok(vec![]);
        }
        let idx =
            Tensor::from_slice(&rows.iter().map(|&i| i as i64).collect::<Vec<_>>()).to_device(self.model.device());
        let cpu = |t: &Tensor| t.index_select(0, &idx).to_device(tch::Device::Cpu);
        let (tokens, lp, lq, len) = (cpu(&self.tokens), cpu(&self.lp), cpu(&self.lq), cpu(&self.len));
        // A freed slot's output goes unused until a job takes it or the batch sheds it: it writes
        // and attends to position 0 alone, which every step reads (the running slots' keys can
        // fit in fewer blocks than its last position; with none to attend to, its row would turn
        // NaN and leave NaN keys where the slot's next job, masked, still multiplies by them), and
        // which that job's prefill overwrites.
        for t in [&mut self.first, &mut self.write] {
            let _ = t.index_fill_(0, &idx, 0);
        }
        let width = self.s.max_new_tokens as usize + 1;
        let (tokens, lp, lq, len) = (
            Vec::<i64>::try_from(tokens.view([-1]))?,
            Vec::<f32>::try_from(lp.view([-1]))?,
            Vec::<f32>::try_from(lq.view([-1]))?,
            Vec::<i64>::try_from(len)?,
        );
        let mut out = vec![];
        for (r, &slot) in rows.iter().enumerate() {
            let n = len[r] as usize;
            let at = r * width..r * width + n;
            let tokens = tokens[at.clone()].to_vec();
            let stop = if tokens.last().is_some_and(|t| self.eos_ids.contains(t)) { Stop::Eos } else { Stop::Length };
            let c = Completion { tokens, logp_model: lp[at.clone()].to_vec(), logp_sampling: lq[at].to_vec(), stop };
            out.push((self.occupied[slot].take().map_or(0, |o| o.job), c));
        }
        Ok(out)
    }

    /// Starts `jobs` (numbered from `first_job`) in the free slots `slots`: each prompt's keys
    /// and values are copied from its prefill, computed once for all its samples — kept in
    /// `prefixes` while `upcoming` jobs (the next ones to start) still need it. Prompts are told
    /// apart by their tokens: the same prompt given twice is prefilled once.
    fn fill(
        &mut self,
        prompts: &[Vec<i64>],
        slots: &[usize],
        jobs: &[Job],
        first_job: usize,
        upcoming: &[Job],
    ) -> Result<()> {
        let dev = self.model.device();
        let mut distinct: Vec<&Vec<i64>> = vec![];
        for j in jobs {
            if !distinct.contains(&&prompts[j.prompt]) {
                distinct.push(&prompts[j.prompt]);
            }
        }
        // Each prompt alone (no padding, nothing beside it): its keys, values and logits are the
        // same bits whatever else starts with it.
        for &p in &distinct {
            if !self.prefixes.contains_key(p) {
                let (pre, logits) = prefill(self.model, p)?;
                self.prefixes.insert(p.clone(), (pre, logits.to_kind(Kind::Float)));
            }
        }
        let mut state = vec![];
        for &p in &distinct {
            let (pre, logits) = &self.prefixes[p];
            let mine: Vec<usize> = (0..jobs.len()).filter(|&k| prompts[jobs[k].prompt] == *p).collect();
            let at = Tensor::from_slice(&mine.iter().map(|&k| slots[k] as i64).collect::<Vec<_>>()).to_device(dev);
            let rows = Tensor::zeros([mine.len() as i64], (Kind::Int64, dev));
            self.cache.fill(&at, pre, &rows);
            let _ = self.logits.index_copy_(0, &at, &logits.index_select(0, &rows));
            for &k in &mine {
                let (len, start, key) = (p.len() as i64, pre.len, jobs[k].stream.0);
                state.extend([
                    slots[k] as i64,
                    len,
                    start,
                    start - len,
                    (key >> 32) as i64,
                    (key & 0xffff_ffff) as i64,
                ]);
                self.occupied[slots[k]] = Some(Occupant { job: first_job + k, steps: 0, start });
            }
        }
        let state = Tensor::from_slice(&state).view([jobs.len() as i64, 6]).to_device(dev);
        let at = state.select(1, 0);
        for (c, t) in
            [&mut self.pos, &mut self.write, &mut self.first, &mut self.hi, &mut self.lo].into_iter().enumerate()
        {
            let _ = t.index_copy_(0, &at, &state.select(1, c as i64 + 1));
        }
        for t in [&mut self.len, &mut self.bad] {
            let _ = t.index_fill_(0, &at, 0);
        }
        let _ = self.ended.index_fill_(0, &at, 0);
        let need: Vec<&Vec<i64>> = upcoming.iter().take(self.occupied.len()).map(|j| &prompts[j.prompt]).collect();
        self.prefixes.retain(|p, _| need.contains(&p));
        Ok(())
    }

    /// Moves the occupied slots into a smaller batch, as `mode` allows ([`Shrink`]): the slots
    /// past the new size move into the free ones below it, the others stay where they are.
    fn shrink(&mut self, mode: Shrink) -> Result<()> {
        let size = self.occupied.len();
        let used = self.occupied.iter().flatten().count();
        let to = if self.graphs {
            let mut to = size;
            while to > 1 && used <= to / 2 {
                to /= 2;
            }
            to
        } else {
            used.div_ceil(SHRINK_ROWS).max(1) * SHRINK_ROWS
        };
        if used == 0 || to >= size || mode == Shrink::Never {
            return Ok(());
        }
        if mode == Shrink::WhenExact && !self.cache.rows_agree(to as i64, self.full)? {
            return Ok(());
        }
        let holes = (0..to).filter(|&i| self.occupied[i].is_none());
        let moves: Vec<(usize, usize)> = (to..size).filter(|&i| self.occupied[i].is_some()).zip(holes).collect();
        let dev = self.model.device();
        let (from, into): (Vec<i64>, Vec<i64>) = moves.iter().map(|&(f, i)| (f as i64, i as i64)).unzip();
        let (from, into) = (Tensor::from_slice(&from).to_device(dev), Tensor::from_slice(&into).to_device(dev));
        let reach = self.occupied.iter().flatten().map(|o| o.start + o.steps + 1).max().unwrap_or(1);
        self.cache.compact(&from, &into, to as i64, whole_blocks(reach));
        for t in [
            &mut self.logits,
            &mut self.pos,
            &mut self.write,
            &mut self.first,
            &mut self.len,
            &mut self.hi,
            &mut self.lo,
            &mut self.bad,
            &mut self.ended,
            &mut self.tokens,
            &mut self.lp,
            &mut self.lq,
        ] {
            let moved = t.index_select(0, &from);
            let _ = t.index_copy_(0, &into, &moved);
            *t = t.narrow(0, 0, to as i64);
        }
        for &(f, i) in &moves {
            self.occupied[i] = self.occupied[f].take();
        }
        self.occupied.truncate(to);
        // Other tensors: the graphs recorded on the old ones go (the host read the device in
        // `collect` since their last replay, so none of them is still running).
        self.recorded = Graphs::default();
        Ok(())
    }

    /// One decoding step of every slot, over the blocks of [`KEY_BLOCK`] keys any slot can have
    /// reached: eagerly, or, with CUDA graphs, replaying the step recorded at this batch size and
    /// key count, so that a graph reads the keys an eager step would and no more (the first step
    /// at each batch size and key count runs eagerly, as the recording's warm-up: libraries set
    /// themselves up on their first call, which a recording must not contain).
    fn step(&mut self) -> Result<()> {
        let reach = self.occupied.iter().flatten().map(|o| o.start + o.steps + 1).max().unwrap_or(1);
        let keys = whole_blocks(reach).min(self.cache.capacity());
        if !self.graphs {
            self.advance(keys)?;
        } else if let Some(g) = self.recorded.get(keys) {
            g.replay()?;
        } else if self.recorded.first_visit(keys) {
            self.advance(keys)?;
        } else {
            let device = self.model.device();
            let pool = match self.recorded.pool {
                Some(p) => p,
                None => *self.recorded.pool.insert(GraphPool::new()?),
            };
            let g = CudaGraph::capture_in(device, Some(pool), || self.advance(keys))?;
            g.replay()?;
            // The capture waited for the device first: no replay of a graph it drops is running.
            self.recorded.insert(keys, g);
        }
        for o in self.occupied.iter_mut().flatten() {
            o.steps += 1;
        }
        Ok(())
    }

    /// Each slot's next token from its logits, with `log π` and `log q` of it and whether the
    /// logits are finite, all `[S]`: in one pass a row on the CPU ([`crate::next_tokens`]), as
    /// libtorch operations elsewhere (the same formulas; the draws agree but for rounding).
    fn next_tokens(&self) -> Result<(Tensor, Tensor, Tensor, Tensor)> {
        // The uniform numbers (None: greedy) and the sampling logits (None: the model's own).
        let (u, z) = match &self.s.decoding {
            Decoding::Greedy => (None, None),
            Decoding::Sample(params) => (
                Some(uniform_tensor(&self.hi, &self.lo, &self.len)),
                (*params != SamplingParams::default()).then(|| sampling_logits(&self.logits, params)),
            ),
        };
        if crate::next_tokens::supports(self.logits.device()) {
            let n = crate::next_tokens::next_tokens(&self.logits, z.as_ref(), u.as_ref())?;
            return Ok((n.token, n.logp, n.logq, n.finite));
        }
        // A row's sum in f64 is finite iff every entry is (NaN and ±∞ carry into it; f32's
        // largest magnitudes times any vocabulary sum far below f64's range): one pass, where
        // `isfinite().all()` takes four.
        let finite = self.logits.sum_dim_intlist(-1, false, Kind::Double).isfinite();
        let logp = self.logits.log_softmax(-1, Kind::Float);
        let (next, lq) = match u {
            None => (self.logits.argmax(-1, false), self.len.zeros_like().to_kind(Kind::Float)),
            Some(u) => {
                // The model's own distribution needs no second normalisation.
                let logq = match &z {
                    None => logp.shallow_clone(),
                    Some(z) => z.log_softmax(-1, Kind::Float),
                };
                let next = draw(&logq, &u);
                (next.shallow_clone(), logq.gather(1, &next.unsqueeze(1), false).squeeze_dim(1))
            }
        };
        let lp = logp.gather(1, &next.unsqueeze(1), false).squeeze_dim(1);
        Ok((next, lp, lq, finite))
    }

    /// The device's part of a step, on fixed shapes (`keys` attended positions), every state
    /// tensor updated in place and nothing read back to the host: draws each slot's next token
    /// from its logits, records it, and feeds it through the model.
    fn advance(&mut self, keys: i64) -> Result<()> {
        let live = self.ended.logical_not(); // [S]
        let (next, lp, lq, finite) = self.next_tokens()?;
        let newly_bad = self.bad.eq(0).logical_and(&live).logical_and(&finite.logical_not());
        self.bad.copy_(&(&self.len + 1).where_self(&newly_bad, &self.bad));
        let at = self.len.unsqueeze(1);
        let _ = self.tokens.scatter_(1, &at, &next.unsqueeze(1));
        let _ = self.lp.scatter_(1, &at, &lp.unsqueeze(1));
        let _ = self.lq.scatter_(1, &at, &lq.unsqueeze(1));
        let _ = self.len.g_add_(&live.to_kind(Kind::Int64));
        let is_eos = next.unsqueeze(1).eq_tensor(&self.eos.unsqueeze(0)).any_dim(1, false);
        let _ = self.ended.logical_or_(&is_eos.logical_or(&self.len.ge(self.s.max_new_tokens)));
        let logits = self.model.decode(&next, &self.pos, &self.write, &self.first, keys, &mut self.cache)?;
        if self.graphs || logits.kind() != Kind::Float {
            self.logits.copy_(&logits); // a recorded step reads and writes fixed addresses
        } else {
            self.logits = logits;
        }
        let advance = self.ended.logical_not().to_kind(Kind::Int64);
        let _ = self.pos.g_add_(&advance);
        let _ = self.write.g_add_(&advance);
        Ok(())
    }
}

/// The prefill of one prompt, alone: its cache (one row, the prompt's positions) and its last
/// logits `[1, V]`.
fn prefill(model: &Llama, prompt: &[i64]) -> Result<(KvCache, Tensor)> {
    let n = prompt.len() as i64;
    let dev = model.device();
    let ids = Tensor::from_slice(prompt).view([1, n]).to_device(dev);
    model.prefill(&ids, &Tensor::ones([1, n], (Kind::Bool, dev)), n)
}

/// Refuses token ids outside `0..vocab` (the embedding would panic on them).
pub fn check_ids(ids: &[i64], vocab: i64, what: &str) -> Result<()> {
    match ids.iter().find(|&&i| !(0..vocab).contains(&i)) {
        Some(i) => bail!("{what} holds token id {i}, outside the vocabulary (0..{vocab})"),
        None => Ok(()),
    }
}

fn non_finite_logits(k: i64) -> String {
    format!(
        "the model's logits for new token {} are not finite (NaN or infinite): its weights overflow in this dtype, or are broken",
        k + 1
    )
}

/// Teacher-forced log-probs of `completion` after `prompt` (ids), under the model at
/// temperature 1: one value per completion token.
pub fn score(model: &Llama, prompt: &[i64], completion: &[i64]) -> Result<Vec<f32>> {
    if prompt.is_empty() || completion.is_empty() {
        bail!("score needs a non-empty prompt and completion");
    }
    check_ids(prompt, model.cfg.vocab_size, "the prompt")?;
    check_ids(completion, model.cfg.vocab_size, "the completion")?;
    let all: Vec<i64> = prompt.iter().chain(completion).copied().collect();
    let n = all.len() as i64;
    if n > model.cfg.max_position_embeddings {
        bail!("prompt + completion ({n} tokens) exceed the model's context of {}", model.cfg.max_position_embeddings);
    }
    let device = model.device();
    let ids = Tensor::from_slice(&all).view([1, n]).to_device(device);
    let mask = Tensor::ones([1, n], (Kind::Bool, device));
    let logp = tch::no_grad(|| -> Result<Tensor> {
        let p = prompt.len() as i64;
        let c = completion.len() as i64;
        // The token at position t is predicted by the logits at t − 1: those of positions
        // p − 1 .. n − 1, [1, c, V].
        let logits = model.next_token_logits(&ids, &mask, p - 1)?.to_kind(Kind::Float);
        if !bool::try_from(logits.isfinite().all())? {
            bail!(
                "the model's logits are not finite (NaN or infinite): its weights overflow in this dtype, or are broken"
            );
        }
        let pred = logits.log_softmax(-1, Kind::Float);
        let labels = ids.narrow(1, p, c).unsqueeze(2);
        Ok(pred.gather(2, &labels, false).view([c]))
    })?;
    Ok(Vec::<f32>::try_from(&logp.to_device(tch::Device::Cpu))?)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each key count has one eager warm-up step, then a recording; the graphs used last are
    /// kept, the least recently used one goes, and one that went is recorded again without a
    /// second warm-up.
    #[test]
    fn graphs_warm_up_each_key_count_once_and_keep_the_last_used() {
        let mut g: Graphs<i64> = Graphs::default();
        assert!(g.get(64).is_none());
        assert!(g.first_visit(64));
        assert!(!g.first_visit(64));
        g.insert(64, 640);
        assert_eq!(g.get(64), Some(&640));
        for k in [128, 192, 256] {
            g.insert(k, k * 10);
        }
        assert_eq!(g.get(64), Some(&640)); // now the most recent: 128 is the least
        g.insert(320, 3200);
        assert!(g.get(128).is_none());
        assert_eq!(g.kept.len(), GRAPHS_KEPT);
        for (k, v) in [(64, 640), (192, 1920), (256, 2560), (320, 3200)] {
            assert_eq!(g.get(k), Some(&v), "{k}");
        }
        g.insert(64, 641); // recorded again: replaces, nothing else goes
        assert_eq!((g.kept.len(), g.get(64)), (GRAPHS_KEPT, Some(&641)));
        // 64 was warmed up (above); 128 never was, so its next visit runs eagerly first.
        assert!(!g.first_visit(64) && g.first_visit(128));
    }

    /// The device's draws are the scalar reference's, bit for bit, over keys and steps that
    /// exercise every bit of both halves.
    #[test]
    fn device_draws_equal_the_scalar_reference() {
        let keys: Vec<Stream> =
            (0..64u64).map(|i| Stream::new(i * 7919, i, i % 5)).chain([Stream(0), Stream(u64::MAX)]).collect();
        for step in [0u32, 1, 2, 127, 65_535, u32::MAX] {
            let hi: Vec<i64> = keys.iter().map(|k| (k.0 >> 32) as i64).collect();
            let lo: Vec<i64> = keys.iter().map(|k| (k.0 & 0xffff_ffff) as i64).collect();
            let steps = vec![i64::from(step); keys.len()];
            let u = uniform_tensor(&Tensor::from_slice(&hi), &Tensor::from_slice(&lo), &Tensor::from_slice(&steps));
            let u = Vec::<f64>::try_from(&u).unwrap();
            for (k, got) in keys.iter().zip(u) {
                assert_eq!(got, uniform(*k, step), "key {:#x}, step {step}", k.0);
                assert!((0.0..1.0).contains(&got));
            }
        }
    }

    /// Draws of one stream over many steps are uniform (Kolmogorov–Smirnov distance of 20,000
    /// draws under 0.012, the 1 % critical value 1.63/√n), and neighbouring streams and steps
    /// are uncorrelated.
    #[test]
    fn draws_are_uniform_and_independent() {
        let n = 20_000u32;
        let mut u: Vec<f64> = (0..n).map(|t| uniform(Stream::new(1, 2, 3), t)).collect();
        let pairs: Vec<(f64, f64)> =
            (0..n as u64).map(|i| (uniform(Stream::new(9, i, 0), 0), uniform(Stream::new(9, i, 1), 0))).collect();
        u.sort_by(f64::total_cmp);
        let ks = u.iter().enumerate().map(|(i, x)| ((i + 1) as f64 / f64::from(n) - x).abs()).fold(0.0, f64::max);
        assert!(ks < 1.63 / f64::from(n).sqrt(), "KS distance {ks}");
        let mean = |f: &dyn Fn(&(f64, f64)) -> f64| pairs.iter().map(f).sum::<f64>() / pairs.len() as f64;
        let (ma, mb) = (mean(&|p| p.0), mean(&|p| p.1));
        let cov = mean(&|p| (p.0 - ma) * (p.1 - mb));
        let corr = cov / (1.0 / 12.0);
        assert!(corr.abs() < 4.0 / f64::from(n).sqrt(), "correlation {corr}");
    }

    /// Drawing by inversion follows the distribution (a chi-square test over 40,000 draws of a
    /// 6-token distribution with a masked token, 1 % critical value 15.1 for 5 degrees of
    /// freedom), never draws a token of probability 0, and stays in range for NaN rows.
    #[test]
    fn inversion_follows_the_distribution() {
        let p = [0.3f64, 0.0, 0.05, 0.4, 0.15, 0.1];
        let n = 40_000i64;
        let logq =
            Tensor::from_slice(&p.iter().map(|&x| x.ln() as f32).collect::<Vec<_>>()).unsqueeze(0).repeat([n, 1]);
        let u: Vec<f64> = (0..n as u64).map(|i| uniform(Stream::new(4, i, 0), 0)).collect();
        let next = Vec::<i64>::try_from(&draw(&logq, &Tensor::from_slice(&u))).unwrap();
        let mut count = [0f64; 6];
        for t in next {
            count[t as usize] += 1.0;
        }
        assert_eq!(count[1], 0.0, "a token of probability 0 was drawn");
        let chi2: f64 = p
            .iter()
            .zip(count)
            .filter(|(p, _)| **p > 0.0)
            .map(|(p, c)| (c - p * n as f64).powi(2) / (p * n as f64))
            .sum();
        assert!(chi2 < 15.1, "chi-square {chi2}, counts {count:?}");
        // Extreme draws: u = 0 and the largest u give the first and last tokens of positive mass.
        let edge = draw(&logq.narrow(0, 0, 2), &Tensor::from_slice(&[0.0, 1.0 - 2f64.powi(-52)]));
        assert_eq!(Vec::<i64>::try_from(&edge).unwrap(), vec![0, 5]);
        let nan = draw(&Tensor::full([1, 6], f64::NAN, (Kind::Float, tch::Device::Cpu)), &Tensor::from_slice(&[0.5]));
        assert!((0..6).contains(&nan.int64_value(&[0])));
    }

    #[test]
    fn streams_differ_by_every_part() {
        let s = Stream::new(1, 2, 3);
        assert_ne!(s, Stream::new(0, 2, 3));
        assert_ne!(s, Stream::new(1, 3, 3));
        assert_ne!(s, Stream::new(1, 2, 4));
        assert_ne!(Stream::new(0, 1, 0), Stream::new(0, 0, 1));
    }
}
