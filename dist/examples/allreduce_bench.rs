//! Times the all-reduce of a gradient-sized f32 tensor across the ranks of a launched group, as
//! `all_reduce_gradients` runs it (25 MiB buckets). For docs/distributed.md:
//!
//! ```text
//! for r in 0 1; do RANK=$r WORLD_SIZE=2 MASTER_PORT=29511 OMP_NUM_THREADS=1 \
//!   cargo run --release -p topr-dist --example allreduce_bench -- 134515008 3 & done; wait
//! ```
//!
//! Arguments: the number of f32 elements (default 134,515,008, SmolLM2-135M's parameters) and the
//! repetitions (default 3). Rank 0 prints one JSON line.
use std::time::{Duration, Instant};
use tch::{Kind, Tensor};
use topr_dist::{Launch, ProcessGroup};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let n: i64 = args.first().map_or(Ok(134_515_008), |a| a.parse())?;
    let reps: usize = args.get(1).map_or(Ok(3), |a| a.parse())?;
    let launch = Launch::from_env()?.ok_or("launch it with RANK and WORLD_SIZE (see the file's docs)")?;
    let pg = ProcessGroup::join(&launch, Duration::from_secs(120))?;
    // One "parameter" per bucket, so that the bucketing of all_reduce_gradients is what runs.
    let per = topr_dist::BUCKET_ELEMENTS.min(n);
    let params: Vec<Tensor> = (0..(n + per - 1) / per)
        .map(|k| {
            let len = per.min(n - k * per);
            let p = Tensor::zeros([len], (Kind::Float, tch::Device::Cpu)).set_requires_grad(true);
            p.sum(Kind::Float).backward();
            p
        })
        .collect();
    pg.all_reduce_gradients(&params)?; // warm-up
    let mut times = vec![];
    for _ in 0..reps {
        pg.barrier()?;
        let t0 = Instant::now();
        pg.all_reduce_gradients(&params)?;
        times.push(t0.elapsed().as_secs_f64());
    }
    if pg.is_main() {
        let mean = times.iter().sum::<f64>() / times.len() as f64;
        println!(
            "{{\"elements\":{n},\"ranks\":{},\"seconds\":{mean:.3},\"times\":{times:?},\"gb_per_s\":{:.2}}}",
            pg.world_size(),
            n as f64 * 4.0 / mean / 1e9
        );
    }
    Ok(())
}
