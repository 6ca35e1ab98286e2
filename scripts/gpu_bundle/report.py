"""The GPU check's report: reads what run.sh left in OUT_DIR (machine.json, stages.jsonl and the
stages' JSON lines in logs/) and writes summary.json and table.md there, and prints the table.

    python3 report.py OUT_DIR

Exits 1 when a stage failed or a parity bound is not met.
"""
import json
import os
import sys

# Parity bounds: f32 on the device against f32 on the CPU, relative to the logits' largest
# magnitude (kernels sum in other orders: differences of a few f32 ulps per layer); bf16 weights
# and activations (8 mantissa bits: 2^-8 = 0.4 % per rounding, accumulated over the layers).
F32_BOUND = 1e-4
BF16_BOUND = 5e-2


def lines(path):
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    pass
    return out


def fmt(x, digits=3):
    if x is None:
        return "—"
    if isinstance(x, bool):
        return "yes" if x else "**no**"
    if isinstance(x, float):
        return f"{x:.{digits}g}"
    return str(x)


def memory_estimate_gib(cfg, tokens, full_logits):
    """docs/gpu.md's arithmetic for a bf16 training step: weights and gradients (2 + 2 bytes a
    parameter), activations (8·hidden + 3·kv_dim + 4·MLP bf16 values a token and layer) and the
    logits (bf16, plus the f32 log-softmax and its gradient on the full-logits path)."""
    h, i, layers, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    kv_dim = kv * (h // heads)
    n = v * h + layers * (2 * h * h + 2 * h * kv_dim + 3 * h * i + 2 * h) + h
    weights = 4 * n
    activations = tokens * layers * (8 * h + 3 * kv_dim + 4 * i) * 2
    logits = tokens * v * ((2 + 4 + 4) if full_logits else 2)
    return (weights + activations + logits) / 2**30


def main():
    out = sys.argv[1]
    logs = os.path.join(out, "logs")
    machine = json.load(open(os.path.join(out, "machine.json")))
    stages = lines(os.path.join(out, "stages.jsonl"))
    by_stage = {s["stage"]: s for s in stages}
    get = lambda name: lines(os.path.join(logs, f"{name}.out"))
    failed = [s["stage"] for s in stages if s["status"] not in ("ok", "skipped")]
    # Stages run.sh skipped at its deadline: not measured, not failed.
    skipped = [s["stage"] for s in stages if s["status"] == "skipped"]
    rows = []  # (section, measurement, value, note)

    parity = next((r for r in get("parity") if r.get("what") == "parity"), None)
    parity_ok = True
    if parity:
        f32_ok, bf16_ok = parity["f32_rel"] <= F32_BOUND, parity["bf16_rel"] <= BF16_BOUND
        parity_ok = f32_ok and bf16_ok and parity["greedy_identical"]
        rows += [
            ("parity", "logits f32, max abs Δ / max abs logit", fmt(parity["f32_rel"]), f"bound {F32_BOUND:g}: {'met' if f32_ok else '**not met**'}"),
            ("parity", "logits bf16, max abs Δ / max abs logit", fmt(parity["bf16_rel"]), f"bound {BF16_BOUND:g}: {'met' if bf16_ok else '**not met**'}"),
            ("parity", "bf16 argmax = f32 CPU argmax", f"{parity['bf16_argmax_agreement']:.1%}", f"{parity['positions']} positions"),
            ("parity", "greedy generations identical (f32)", fmt(parity["greedy_identical"]), f"{parity['greedy_tokens']} tokens"),
        ]
        if "sampled_identical" in parity:
            rows.append(("parity", "sampled generations identical to the CPU's (f32, seed 0)", fmt(parity["sampled_identical"]), "the same draws on both; rounding alone can differ"))
        for key, what in [("graphs_greedy_identical", "greedy"), ("graphs_sampled_identical", "sampled")]:
            if key in parity:
                rows.append(("parity", f"{what} generations identical with CUDA graphs and eagerly (f32)", fmt(parity[key]), ""))

    peak = next((r for r in get("peak") if r.get("what") == "peak"), None)
    if peak:
        rows.append(("throughput", f"{peak.get('kind', 'bf16')} matrix product {peak['n']}³", f"{peak['tflops']:.1f} TFLOP/s", "the MFU denominator, measured"))
    # run.sh copies the model's config and each training's metrics out of its work folder
    # (results of 2026-11-30 still hold that folder as work/).
    cfg_path = next((p for p in (os.path.join(out, "big-config.json"), os.path.join(out, "work", "big", "config.json")) if os.path.exists(p)), None)
    cfg = json.load(open(cfg_path)) if cfg_path else None
    # transformers' figures on the same model, sizes and dtype (bench-transformers), by measurement.
    hf = {(r["what"], r.get("batch")): r for r in get("bench-transformers") if r.get("impl") == "transformers"}
    compiled = {r.get("batch"): r for r in get("bench-transformers-compiled") if r.get("what") == "generate"}

    def versus(what, batch, tokens_per_s):
        ref = hf.get((what, batch))
        return f"; transformers {ref['tokens_per_s']:.0f} tokens/s: ratio {tokens_per_s / ref['tokens_per_s']:.2f}" if ref else ""

    for r in get("bench"):
        if r.get("what") == "generate" and "error" in r:
            how = "CUDA graphs" if r.get("cuda_graphs") else "eager"
            rows.append(("throughput", f"generation, batch {r['batch']}, {how}", "**failed**", (r["error"].splitlines() or [""])[0][:200]))
        elif r.get("what") == "generate":
            mfu = r["share_of_peak"] if "share_of_peak" in r else None
            note = f"greedy, {r['new_tokens']} new tokens" + versus("generate", r["batch"], r["tokens_per_s"])
            ref = compiled.get(r["batch"])
            if ref:
                note += f"; transformers static cache + torch.compile {ref['tokens_per_s']:.0f} tokens/s: ratio {r['tokens_per_s'] / ref['tokens_per_s']:.2f}"
            if mfu is not None:
                note += f"; {r['achieved_tflops']:.3g} TFLOP/s, {mfu:.2%} of the measured peak"
            if r.get("bandwidth_share") is not None:
                note += f"; {r['bandwidth_share']:.1%} of the copy-bandwidth limit"
            if r.get("steady_tokens_per_s") is not None:
                note += f"; the decoding steps alone (without prefill, first step and recording) {r['steady_tokens_per_s']:.0f} tokens/s"
            how = "CUDA graphs" if r.get("cuda_graphs") else "eager"
            rows.append(("throughput", f"generation, batch {r['batch']}, {how}", f"{r['tokens_per_s']:.0f} tokens/s", note))
        elif r.get("what") == "copy_bandwidth":
            rows.append(("throughput", "device-to-device copy", f"{r['bytes_per_s'] / 1e9:.0f} GB/s", "read + written, the bandwidth share's denominator"))
        elif r.get("what") == "sample":
            note = f"{r['completions']} completions, mean length {r['mean_len']:.0f}, longest {r['max_len']}, {r['slots']} slots"
            rows.append(("throughput", f"sampling workload, {r['batching']} batching", f"{r['tokens_per_s']:.0f} tokens/s", note))
        elif r.get("what", "").startswith("train_fwd_bwd"):
            fused = r["what"].endswith("fused_logprobs")
            mfu = r["flops_per_token"] * r["tokens_per_s"] / (peak["tflops"] * 1e12) if peak else None
            path = "fused log-probs" if fused else "full logits"
            note = f"{r['batch']}×{r['len']} tokens, forward + backward ({path})"
            note += versus("train_fwd_bwd", r["batch"], r["tokens_per_s"])
            rows.append(("throughput", f"training, {path}", f"{r['tokens_per_s']:.0f} tokens/s", note))
            rows.append(("throughput", f"model FLOP utilisation, {path}", f"{mfu:.1%}" if mfu is not None else "—", "6N + 12·L·d·T FLOPs a token over the measured peak"))
            if cfg and not fused and "bench" in by_stage:
                est = memory_estimate_gib(cfg, r["batch"] * r["len"], True)
                mib = by_stage["bench"]["peak_mib"]
                rows.append(("memory", "peak GPU memory of the bench stage", f"{mib / 1024:.1f} GiB" if mib else "—", f"docs/gpu.md arithmetic for its training step: {est:.1f} GiB"))

    # The profile stage (bench --profile): where a decoding step's time goes. Its own generation
    # and training lines repeat the bench stage's at a smaller size and are left out.
    for r in get("profile"):
        if r.get("what") != "profile":
            continue
        how = "CUDA graphs" if r.get("cuda_graphs") else "eager"
        label = f"generation, batch {r['batch']}, {how}"
        if "error" in r:
            rows.append(("profile", label, "**failed**", (r["error"].splitlines() or [""])[0][:200]))
            continue
        p = r["summary"]
        step = "a replayed step" if r.get("cuda_graphs") else "a token (prefill included)"
        top = "; ".join(f"{k['name'][:60]} {k['us_per_step']:.0f} µs ×{k['calls_per_step']:.3g}" for k in (p["top_kernels"] or p["top_ops"])[:3])
        note = (f"{p['kernels_per_step']:.0f} kernels ({p['kernel_us_per_step']:.0f} µs) and {p['launches_per_step']:.0f} launches {step},"
                f" device busy {p['device_busy_share']:.0%} of the wall time, {p['device_to_host_per_step']:.2g} copies to the host a step;"
                f" without the profiler {r['unprofiled_wall_us_per_token']:.0f} µs a token (whole call); costliest: {top}")
        if "warning" in r:
            note += f"; **{r['warning']}**"
        rows.append(("profile", f"{label}: wall time {step}", f"{p['wall_us_per_step']:.0f} µs", note))

    mine = {(r["loss"], r["checks"]): r for r in get("losses") if r.get("what") == "loss"}
    theirs = {r["loss"]: r for r in get("losses-pytorch") if r.get("what") == "loss"}
    for loss in ["topr_token_loss", "ppo_clip_loss", "dpo_loss"]:
        full, fast, ref = mine.get((loss, "full")), mine.get((loss, "shapes")), theirs.get(loss)
        if not full:
            continue
        shape = f"B = {full['batch']}, T = {full['len']}"
        value = f"{full['ms']:.3g} ms (full checks), {fast['ms']:.3g} ms (shapes only)" if fast else f"{full['ms']:.3g} ms"
        note = f"{shape}; host reads a call: {full['host_reads_per_call']} full, {fast['host_reads_per_call'] if fast else '—'} shapes only"
        if ref:
            note += f"; PyTorch {ref['ms']:.3g} ms: ratio {full['ms'] / ref['ms']:.2f} (full), {fast['ms'] / ref['ms']:.2f} (shapes only)" if fast else ""
        rows.append(("losses", f"{loss} forward + backward", value, note))

    for s in stages:
        if s["stage"].startswith("train-"):
            _, objective, optimizer = s["stage"].split("-", 2)
            # The data-parallel stages (train-topr-dp1, train-topr-dp1-gloo) train with AdamW.
            if optimizer.startswith("dp1"):
                engine = "Gloo" if optimizer.endswith("gloo") else "the build's engine for the device"
                optimizer = f"adamw, a launched group of one rank ({engine})"
            steps = lines(os.path.join(logs, f"{s['stage']}.metrics.jsonl")) or lines(os.path.join(out, "work", s["stage"], "metrics.jsonl"))
            last = steps[-1]["stats"]["loss"] if steps else None
            note = f"{len(steps)} steps, last loss {fmt(last)}, {s['seconds']:.1f} s, peak {s['peak_mib'] or '—'} MiB"
            # A launched group's engine, as the binary said it (the dp1 stages).
            err = os.path.join(logs, f"{s['stage']}.err")
            said = [l.strip() for l in open(err)] if os.path.exists(err) else []
            note += "".join(f"; {l[len('data parallel: '):]}" for l in said if l.startswith("data parallel: "))
            rows.append(("objectives", f"train {objective}, {optimizer}", s["status"], note))

    demo = lines(os.path.join(out, "demo-iterations.jsonl"))
    for r in demo:
        label = "warm-up model" if r["iteration"] == 0 else f"after iteration {r['iteration']}"
        pos = r.get("data_positive_fraction")
        rows.append(("demo", f"held-out accuracy, {label}", f"{r['accuracy']:.3f}", f"its samples {pos:.1%} positive" if pos is not None else ""))
    if "demo" in by_stage:
        rows.append(("demo", "demo wall time", f"{by_stage['demo']['seconds']:.0f} s", by_stage["demo"]["status"]))

    total = sum(s["seconds"] for s in stages)
    head = f"GPU check: {machine.get('gpu', machine['device'])}, torch {machine['torch']} (CUDA {machine['cuda']}), {total:.0f} s of stages"
    table = [head, "", "| section | measurement | value | note |", "|---|---|---|---|"]
    table += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows]
    if failed:
        table += ["", "Failed stages: " + ", ".join(failed) + " (see logs/)."]
    if skipped:
        table += ["", "Skipped at the deadline (not measured): " + ", ".join(skipped) + "."]
    text = "\n".join(table) + "\n"
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(text)
    summary = {"machine": machine, "stages": stages, "failed": failed, "skipped": skipped, "parity_ok": parity_ok,
               "rows": [dict(zip(["section", "measurement", "value", "note"], r)) for r in rows]}
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(text)
    sys.exit(1 if failed or not parity_ok else 0)


if __name__ == "__main__":
    main()
