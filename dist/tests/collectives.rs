//! Two real processes on the loopback: this test binary runs itself again as the ranks (the
//! `rank_worker` test, ignored unless a parent starts it with the launch variables).

use std::process::{Command, Output};
use std::time::{Duration, Instant};
use tch::{Kind, Tensor};
use topr_dist::{DistError, Launch, ProcessGroup};

/// A port nobody listens on now.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// Runs `scenario` as `world` ranks of this binary's `rank_worker` test and returns their outputs.
fn launch(scenario: &str, world: usize) -> Vec<Output> {
    let port = free_port().to_string();
    let exe = std::env::current_exe().unwrap();
    let children: Vec<_> = (0..world)
        .map(|rank| {
            Command::new(&exe)
                .args(["--exact", "rank_worker", "--include-ignored", "--nocapture", "--test-threads", "1"])
                .env("TOPR_DIST_SCENARIO", scenario)
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", world.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", &port)
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    children.into_iter().map(|c| c.wait_with_output().unwrap()).collect()
}

fn join(timeout: Duration) -> Result<ProcessGroup, DistError> {
    ProcessGroup::join(&Launch::from_env().unwrap().expect("launched"), timeout)
}

#[test]
#[ignore = "a rank started by the other tests"]
fn rank_worker() {
    let Ok(scenario) = std::env::var("TOPR_DIST_SCENARIO") else { return };
    match scenario.as_str() {
        "sums" => {
            let pg = join(Duration::from_secs(60)).unwrap();
            let r = pg.rank() as f64;
            // f32 and f64 tensors, summed in place.
            let mut a = Tensor::from_slice(&[r + 1.0, 10.0 * r]).to_kind(Kind::Float);
            pg.all_reduce_sum(&mut a).unwrap();
            assert_eq!(Vec::<f32>::try_from(&a).unwrap(), vec![3.0, 10.0]);
            let mut v = [r, 0.5];
            pg.all_reduce_f64(&mut v).unwrap();
            assert_eq!(v, [1.0, 1.0]);
            // Broadcast from rank 1.
            let mut b = Tensor::from_slice(&[r * 7.0]);
            pg.broadcast(&mut b, 1).unwrap();
            assert_eq!(b.double_value(&[0]), 7.0);
            // Gradients of parameters of two kinds (two buckets), summed in place.
            let w = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0]).view([2, 2]).set_requires_grad(true);
            let u = Tensor::from_slice(&[1.0f64]).set_requires_grad(true);
            ((&w * (r + 1.0)).sum(Kind::Float) + (&u * (r + 2.0)).sum(Kind::Double)).backward();
            pg.all_reduce_gradients(&[w.shallow_clone(), u.shallow_clone()]).unwrap();
            assert_eq!(Vec::<f32>::try_from(w.grad().reshape([-1])).unwrap(), vec![3.0; 4]);
            assert_eq!(u.grad().double_value(&[0]), 5.0);
            pg.barrier().unwrap();
            // Bad arguments are errors naming them, before any collective.
            let err = pg.broadcast(&mut b, 2).unwrap_err();
            assert!(err.to_string().starts_with("root:"), "{err}");
            let fresh = Tensor::from_slice(&[1.0f32]).set_requires_grad(true);
            let err = pg.all_reduce_gradients(&[fresh]).unwrap_err();
            assert!(err.to_string().contains("parameter 0 has no gradient"), "{err}");
            println!("rank {} ok", pg.rank());
        }
        "dead_peer" => {
            let pg = join(Duration::from_secs(30)).unwrap();
            pg.barrier().unwrap();
            if pg.rank() == 1 {
                std::process::exit(3); // dies before the collective
            }
            let t0 = Instant::now();
            let mut t = Tensor::from_slice(&[1.0f32]);
            let err = pg.all_reduce_sum(&mut t).unwrap_err();
            println!("rank 0 error after {:.1} s: {err}", t0.elapsed().as_secs_f64());
            assert!(matches!(err, DistError::Collective { rank: 0, op: "all-reduce", .. }), "{err}");
            assert!(!err.to_string().contains('\n'));
        }
        other => panic!("unknown scenario {other}"),
    }
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned() + &String::from_utf8_lossy(&o.stderr)
}

#[test]
fn two_ranks_sum_broadcast_and_barrier() {
    for (rank, o) in launch("sums", 2).iter().enumerate() {
        assert!(o.status.success(), "rank {rank}: {}", stdout(o));
        assert!(stdout(o).contains(&format!("rank {rank} ok")), "{}", stdout(o));
    }
}

#[test]
fn a_dead_peer_is_an_error_not_a_hang() {
    let t0 = Instant::now();
    let out = launch("dead_peer", 2);
    assert_eq!(out[1].status.code(), Some(3), "{}", stdout(&out[1]));
    assert!(out[0].status.success(), "rank 0: {}", stdout(&out[0]));
    assert!(stdout(&out[0]).contains("rank 0 error after"), "{}", stdout(&out[0]));
    assert!(t0.elapsed() < Duration::from_secs(60), "took {:?}", t0.elapsed());
}

#[test]
fn a_missing_peer_times_out_at_the_rendezvous() {
    let launch = Launch { rank: 0, world_size: 2, master_addr: "127.0.0.1".into(), master_port: free_port() };
    let t0 = Instant::now();
    let err = ProcessGroup::join(&launch, Duration::from_secs(2)).err().expect("no peer joined");
    assert!(matches!(err, DistError::Join { rank: 0, world_size: 2, .. }), "{err}");
    assert!(t0.elapsed() < Duration::from_secs(30), "took {:?}", t0.elapsed());
}

#[test]
fn launch_variables_are_checked() {
    let get = |vars: &'static [(&'static str, &'static str)]| {
        move |k: &str| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())
    };
    assert_eq!(Launch::from_vars(get(&[("RANK", "0")])).unwrap(), None);
    let err = |vars| Launch::from_vars(get(vars)).unwrap_err().to_string();
    assert!(err(&[("WORLD_SIZE", "2")]).starts_with("RANK="), "{}", err(&[("WORLD_SIZE", "2")]));
    assert!(err(&[("WORLD_SIZE", "2"), ("RANK", "2")]).contains("0..2"));
    assert!(err(&[("WORLD_SIZE", "x"), ("RANK", "0")]).starts_with("WORLD_SIZE=\"x\""));
    assert!(err(&[("WORLD_SIZE", "0"), ("RANK", "0")]).contains(">= 1"));
    assert!(err(&[("WORLD_SIZE", "1"), ("RANK", "0"), ("MASTER_PORT", "70000")]).starts_with("MASTER_PORT="));
}
