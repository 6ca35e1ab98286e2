#!/usr/bin/env python3
"""Compares two runs of `llama study` arm by arm: the greedy held-out accuracy at every
iteration, each run's mean ± standard error over its seeds, and the difference of the means
± the standard error of that difference (independent seeds: the two SEs added in quadrature).

    python3 scripts/compare_studies.py BEFORE AFTER [--claim NAME]

BEFORE and AFTER are study.jsonl files (or the folders holding one), as `llama study` writes
them. Prints a Markdown table per claim, one row per arm and iteration that both runs hold, then
each run's per-seed values. For two versions of the code, or two machines, on the same recipe:
the seeds of the two runs draw other samples, so their differences are not paired.
"""
import json
import math
import os
import sys


def rows(path):
    if os.path.isdir(path):
        path = os.path.join(path, "study.jsonl")
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def by_cell(records):
    """{(claim, arm, iteration): {seed: accuracy}}"""
    out = {}
    for r in records:
        key = (r["claim"], r["arm"], r["iteration"])
        out.setdefault(key, {})[r["seed"]] = r["accuracy"]
    return out


def mean_se(values):
    n = len(values)
    m = sum(values) / n
    if n < 2:
        return m, float("nan")
    var = sum((v - m) ** 2 for v in values) / (n - 1)
    return m, math.sqrt(var / n)


def main(argv):
    args = [a for a in argv if not a.startswith("--")]
    claim = None
    if "--claim" in argv:
        i = argv.index("--claim")
        if i + 1 >= len(argv):
            sys.exit("--claim needs a name")
        claim = argv[i + 1]
        args.remove(claim)
    if len(args) != 2:
        sys.exit(__doc__.strip().splitlines()[4].strip())
    before, after = (by_cell(rows(p)) for p in args)
    shared = sorted(k for k in before if k in after and (claim is None or k[0] == claim))
    if not shared:
        sys.exit("the two studies share no claim, arm and iteration")
    for c in sorted({k[0] for k in shared}):
        print(f"## {c}\n")
        print("| arm | iteration | before | after | after − before | ÷ its SE |")
        print("|---|---:|---:|---:|---:|---:|")
        for k in (k for k in shared if k[0] == c):
            (mb, sb), (ma, sa) = mean_se(list(before[k].values())), mean_se(list(after[k].values()))
            se = math.sqrt(sb * sb + sa * sa)
            z = (ma - mb) / se if se > 0 else float("nan")
            print(
                f"| {k[1]} | {k[2]} | {mb:.3f} ± {sb:.3f} ({len(before[k])}) | {ma:.3f} ± {sa:.3f} ({len(after[k])})"
                f" | {ma - mb:+.3f} ± {se:.3f} | {z:+.1f} |"
            )
        print()
        for k in (k for k in shared if k[0] == c):
            seeds = sorted(set(before[k]) | set(after[k]))
            per = ", ".join(
                f"{s}: {before[k].get(s, float('nan')):.3f} → {after[k].get(s, float('nan')):.3f}" for s in seeds
            )
            print(f"- {k[1]}, iteration {k[2]}, per seed (before → after): {per}")
        print()


if __name__ == "__main__":
    main(sys.argv[1:])
