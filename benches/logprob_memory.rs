//! Peak memory of one forward + backward of log-prob extraction, naive vs chunked vs fused, for
//! V = 32k and 128k (CPU, the shapes of `benches/logprobs.rs`), in f32 and with bf16 weights and
//! activations.
//!
//! Each measurement runs in a fresh child process (this binary, re-invoked with `--one`), which
//! reports its peak resident set (`VmHWM`) minus its resident set just before the computation,
//! so the figures are the extra memory each method needs. Run: `cargo bench --bench logprob_memory`.

use std::process::Command;
use tch::{Device, Kind, Tensor};
use topr_loss::{LogProbConfig, backward_through_fused_logprobs, backward_through_logprobs};

const B: i64 = 4;
const T: i64 = 256;
const H: i64 = 128;

fn status_kib(field: &str) -> i64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    s.lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(-1)
}

fn one(variant: &str, v: i64) {
    tch::manual_seed(0);
    let (variant, kind) = match variant.strip_suffix("-bf16") {
        Some(base) => (base, Kind::BFloat16),
        None => (variant, Kind::Float),
    };
    let opts = (kind, Device::Cpu);
    let hidden = (Tensor::randn([B, T, H], opts) * 0.5).set_requires_grad(true);
    let weight = (Tensor::randn([v, H], opts) * 0.05).set_requires_grad(true);
    let labels = Tensor::randint(v, [B, T], (Kind::Int64, Device::Cpu));
    let cfg = LogProbConfig::new().with_chunk_tokens(64);
    // Warm up libtorch's kernels on a tiny problem so their one-off allocations do not count.
    let _ = Tensor::randn([4, 4], opts).matmul(&Tensor::randn([4, 4], opts)).log_softmax(-1, Kind::Float);
    let before = status_kib("VmRSS:");
    match variant {
        "naive" => {
            let logits = hidden.matmul(&weight.tr());
            // The usual recipe: upcast the whole [B, T, V] to f32, then log_softmax + gather.
            let lp = logits.to_kind(Kind::Float).log_softmax(-1, Kind::Float).gather(2, &labels.unsqueeze(2), false);
            (-lp.sum(Kind::Float)).backward();
        }
        "chunked" => {
            let logits = hidden.matmul(&weight.tr());
            let _ = backward_through_logprobs(&logits, &labels, None, &cfg, |x| {
                Ok::<_, topr_loss::LossError>(-x.logp.sum(Kind::Float))
            })
            .unwrap();
        }
        "fused" => {
            let _ = backward_through_fused_logprobs(&hidden, &weight, &labels, None, &cfg, |x| {
                Ok::<_, topr_loss::LossError>(-x.logp.sum(Kind::Float))
            })
            .unwrap();
        }
        other => panic!("unknown variant {other}"),
    }
    let peak = status_kib("VmHWM:");
    println!("{}", peak - before);
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let Some(i) = args.iter().position(|a| a == "--one") {
        one(&args[i + 1], args[i + 2].parse().unwrap());
        return;
    }
    let exe = std::env::current_exe().unwrap();
    println!("peak extra memory of one forward+backward, B={B} T={T} H={H}, chunk 64 tokens");
    println!("{:>8} {:>14} {:>12} {:>16}", "V", "variant", "extra MiB", "[B,T,V] f32 MiB");
    for v in [32_768i64, 131_072] {
        let full = (B * T * v * 4) as f64 / (1 << 20) as f64;
        for variant in ["naive", "chunked", "fused", "naive-bf16", "chunked-bf16", "fused-bf16"] {
            let out = Command::new(&exe).args(["--one", variant, &v.to_string()]).output().unwrap();
            let kib: f64 = String::from_utf8_lossy(&out.stdout).trim().parse().unwrap_or(f64::NAN);
            println!("{v:>8} {variant:>14} {:>12.0} {full:>16.0}", kib / 1024.0);
        }
    }
}
