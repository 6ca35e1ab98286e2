#!/usr/bin/env python3
"""Summarises `scripts/smollm2_compare.sh`'s arms over the grid's seeds, from the per-question
records, and writes the table to RECORDS/summary.md (and prints it).

    python3 scripts/compare_over_seeds.py [RECORDS] [GRID]
    # defaults: docs/study/real-compare and docs/study/real

RECORDS holds seed-N/compare.jsonl and seed-N/ARM/eval.questions.jsonl (what `llama compare`
wrote for seed N); GRID the grid's records, whose seed-N/real-topr-p0.5/iter-1/eval.questions.jsonl
is the TOPR model (p̃ = 0.5) every arm is paired with, and seed-N/real-sft the SFT arm, shown
for reference. For each arm, over the seeds that ran it: greedy pass@1, invalid rate and the
share right among the answers given (mean ± standard error over seeds), and the arm minus TOPR
(p̃ = 0.5), paired by seed (standard error over seeds) and by seed and question (standard error
over all those questions), with which standard error is the larger. Every accuracy is recounted
from the questions and checked against compare.jsonl's (the run's model's against the grid's
TOPR records); a mismatch stops the script (exit 1).
"""
import glob
import os
import re
import sys

from check_real_study import fmt, jsonl, larger_se, mean_se

RECORDS = sys.argv[1] if len(sys.argv) > 1 else "docs/study/real-compare"
GRID = sys.argv[2] if len(sys.argv) > 2 else "docs/study/real"
TOPR = "real-topr-p0.5"


def questions(path):
    """id -> (correct, invalid) of a greedy evaluation's per-question file."""
    return {q["id"]: (float(q["greedy_correct"]), float(q["greedy_invalid"])) for q in jsonl(path)}


def main():
    seeds = sorted(int(re.search(r"seed-(\d+)$", d).group(1)) for d in glob.glob(os.path.join(RECORDS, "seed-*")))
    grid = lambda s, arm: os.path.join(GRID, f"seed-{s}", arm, "iter-1", "eval.questions.jsonl")
    arms = {}  # arm -> {seed: per-question}
    for s in seeds:
        rows = jsonl(os.path.join(RECORDS, f"seed-{s}", "compare.jsonl"))
        for row in rows:
            if row["arm"] == "mu":
                continue
            # The run's model is the grid's TOPR arm: the same accuracy as its records.
            where = grid(s, TOPR) if row["arm"] == "run" else os.path.join(RECORDS, f"seed-{s}", row["arm"], "eval.questions.jsonl")
            q = questions(where)
            recount = sum(c for c, _ in q.values()) / len(q)
            if abs(recount - row["accuracy"]) > 1e-12:
                sys.exit(f"seed {s} {row['arm']}: compare.jsonl has accuracy {row['accuracy']}, the questions {recount}")
            if row["arm"] != "run":
                arms.setdefault(row["arm"], {})[s] = q
    reference = {TOPR: {}, "real-sft": {}}
    for arm in reference:
        for s in seeds:
            if os.path.exists(grid(s, arm)):
                reference[arm][s] = questions(grid(s, arm))
    lines = [
        "| arm | seeds | greedy pass@1 | invalid | right among given | − TOPR p̃ 0.5 (SE over seeds) | − TOPR p̃ 0.5 (SE over questions) | larger SE |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for arm, by_seed in list(reference.items()) + sorted(arms.items()):
        have = sorted(s for s in by_seed if s in reference[TOPR])
        acc = {s: mean_se([c for c, _ in by_seed[s].values()])[0] for s in have}
        inv = {s: mean_se([v for _, v in by_seed[s].values()])[0] for s in have}
        given = [acc[s] / (1 - inv[s]) for s in have if inv[s] < 1.0]
        cells = [arm, str(len(have)), fmt(mean_se(list(acc.values()))), fmt(mean_se(list(inv.values()))), fmt(mean_se(given))]
        if arm == TOPR:
            cells += ["—", "—", "–"]
        else:
            per_seed, per_question = [], []
            for s in have:
                a, b = by_seed[s], reference[TOPR][s]
                d = [a[q][0] - b[q][0] for q in a if q in b]
                per_seed.append(mean_se(d)[0])
                per_question.extend(d)
            over_seeds, over_questions = mean_se(per_seed), mean_se(per_question)
            cells += [fmt(over_seeds), fmt(over_questions).replace(" (one seed)", ""), larger_se(over_seeds[1], over_questions[1])]
        lines.append("| " + " | ".join(cells) + " |")
    text = (
        f"Arms trained by `scripts/smollm2_compare.sh` on the SmolLM2 grid's first data set of each seed, "
        f"beside the grid's TOPR (p̃ = 0.5) and SFT arms (greedy pass@1 on the seed's 256 held-out "
        f"questions after one iteration; mean ± standard error over seeds; the differences paired "
        f"with TOPR's model, by seed and by seed and question). Drawn by `scripts/compare_over_seeds.py`.\n\n"
        + "\n".join(lines)
        + "\n"
    )
    with open(os.path.join(RECORDS, "summary.md"), "w") as f:
        f.write(text)
    print(text, end="")


if __name__ == "__main__":
    main()
