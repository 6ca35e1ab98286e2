#!/usr/bin/env python3
"""Recomputes every statistic of the real-model study's tables from its per-question records,
without the Rust code, and compares them with the tables in study.md, cell by cell.

    python3 scripts/check_real_study.py [RECORDS]      # default docs/study/real

RECORDS is a folder of `scripts/smollm2_study.sh`'s records (or the study's work directory):
study.md (drawn by `llama study --report-only`) and, per seed and arm, the held-out evaluation's
per-question files (`eval-initial.questions.jsonl`, `iter-N/eval.questions.jsonl`, and the sampled
ones `eval-initial-k4…`, `iter-N/eval-k4…`) and the seed's first data set
(`shared/*/iter-1-data.jsonl`). Accuracy and invalid rate are recounted from the questions, the
share of positives from the data set, maj@k with ties scored 1/t. Exits 1 and names every cell
that differs; prints how many cells were checked.
"""
import functools
import glob
import json
import math
import os
import re
import sys

RECORDS = sys.argv[1] if len(sys.argv) > 1 else "docs/study/real"
HELD_OUT = 256  # held-out questions a seed (Scale::real().eval_n)
# Each claim's arms, in the study's order (examples/llama/src/study/claims.rs).
ARMS = {
    "real-negatives": ["real-topr-p0.5", "real-sft", "real-reinforce", "real-tis-p0.5"],
    "real-composition": ["real-topr-p0.5", "real-topr-p0.05", "real-topr-p0.1", "real-topr-p0.2"],
    "real-iterated": ["real-topr-p0.5"],
}
# The claims with a sampled evaluation, and its samples a question (Claim::sampled_k).
SAMPLED_K = {"real-negatives": 4}


def jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def total(v):
    """A plain left-to-right sum, as the report's (Python 3.12's sum() compensates)."""
    t = 0.0
    for x in v:
        t += x
    return t


def mean_se(v):
    if not v:
        return (math.nan, math.nan)
    m = total(v) / len(v)
    if len(v) < 2:
        return (m, math.nan)
    var = total([(x - m) ** 2 for x in v]) / (len(v) - 1)
    return (m, math.sqrt(var / len(v)))


def fmt(ms):
    m, se = ms
    if math.isnan(m):
        return "–"
    if math.isnan(se):
        return f"{m:.3f} (one seed)"
    return f"{m:.3f} ± {se:.3f}"


def seeds(md):
    """The seeds the tables are drawn over: 0..N, N from the heading's "N seed(s) planned"."""
    return list(range(int(re.search(r"(\d+) seed\(s\) planned", md).group(1))))


def arm_dir(seed, arm):
    return os.path.join(RECORDS, f"seed-{seed}", arm)


@functools.lru_cache(maxsize=None)
def greedy(seed, arm, i):
    """Per question (id -> (correct, invalid)) of the arm's evaluation at iteration i, or None."""
    d = arm_dir(seed, arm)
    path = os.path.join(d, "eval-initial.questions.jsonl") if i == 0 else os.path.join(d, f"iter-{i}", "eval.questions.jsonl")
    if not os.path.exists(path):
        return None
    return {q["id"]: (float(q["greedy_correct"]), float(q["greedy_invalid"])) for q in jsonl(path)}


def accuracy(seed, arm, i):
    return mean_se([c for c, _ in greedy(seed, arm, i).values()])[0]


def invalid(seed, arm, i):
    return mean_se([v for _, v in greedy(seed, arm, i).values()])[0]


def finished(seed, arm, i):
    """Whether iteration i of the arm finished: the arm's record of iterations has its row (the
    report's rule), and its per-question evaluation is there."""
    path = os.path.join(arm_dir(seed, arm), "iterations.jsonl")
    if not os.path.exists(path) or not any(r["iteration"] == i for r in jsonl(path)):
        return False
    return greedy(seed, arm, i) is not None


def positives(seed, arm):
    """The share of correct completions in the data set the arm's first iteration trained on: the
    seed's shared data set whose sampling record is the arm's."""
    mine = os.path.join(arm_dir(seed, arm), "iter-1", "data.jsonl.run.json")
    if not os.path.exists(mine):
        return None
    record = json.load(open(mine))
    for f in glob.glob(os.path.join(RECORDS, f"seed-{seed}", "shared", "*", "iter-1-data.jsonl")):
        if os.path.exists(f + ".run.json") and json.load(open(f + ".run.json")) == record:
            rows = jsonl(f)
            return sum(1 for r in rows if r["correct"]) / len(rows)
    return None


def majority_credit(answers, reference):
    same = lambda a, b: abs(a - b) <= 1e-6 * max(abs(b), 1.0)
    valid = [a for a in answers if a is not None]
    if not valid:
        return 0.0
    votes = {a: sum(1 for b in valid if same(b, a)) for a in valid}
    top = max(votes.values())
    leaders = []
    for a in valid:
        if votes[a] == top and not any(same(a, l) for l in leaders):
            leaders.append(a)
    return sum(1 for l in leaders if same(l, reference)) / len(leaders)


@functools.lru_cache(maxsize=None)
def sampled(seed, arm, i, k):
    """Per question (id -> the six sampled measures) of the arm's sampled evaluation, or None."""
    d = arm_dir(seed, arm)
    name = f"eval-initial-k{k}" if i == 0 else os.path.join(f"iter-{i}", f"eval-k{k}")
    path = os.path.join(d, name + ".questions.jsonl")
    if not os.path.exists(path) or not os.path.exists(os.path.join(d, name + ".json")):
        return None
    out = {}
    for q in jsonl(path):
        c = sum(q["sample_correct"])
        out[q["id"]] = [
            c / k,
            majority_credit(q["sample_answers"], q["reference"]),
            float(c > 0),
            sum(1 for a in q["sample_answers"] if a is None) / k,
            float(c == 0),
            float(c <= 1),
        ]
    return out


def larger_se(over_seeds, over_questions):
    """Which standard error of a paired difference is the larger ("–": one is missing)."""
    a, b = over_seeds, over_questions
    return "–" if math.isnan(a) or math.isnan(b) else "seeds" if a > b else "questions" if a < b else "equal"


def tables(md):
    """study.md's tables, by section: a list of (header cells, {first cell: row cells})."""
    out = {}
    section = None
    lines = md.splitlines()
    for n, line in enumerate(lines):
        if line.startswith("## "):
            section = line[3:].strip()
            out[section] = []
        elif section and line.startswith("| ") and n + 1 < len(lines) and lines[n + 1].startswith("|---"):
            header = [c.strip() for c in line.strip("|").split("|")]
            rows = {}
            for row in lines[n + 2 :]:
                if not row.startswith("|"):
                    break
                cells = [c.strip() for c in row.strip("|").split("|")]
                rows[cells[0]] = cells
            out[section].append((header, rows))
    return out


def main():
    md = open(os.path.join(RECORDS, "study.md")).read()
    all_seeds = seeds(md)
    checked, wrong = 0, []

    def check(where, got, want):
        nonlocal checked
        checked += 1
        if got != want:
            wrong.append(f"{where}: study.md has {got!r}, recomputed {want!r}")

    sections = tables(md)
    check("claims", sorted(sections), sorted(ARMS))
    for claim, found in sections.items():
        main_header, main_rows = found[0]
        iters = max(int(h.split()[1]) for h in main_header if h.startswith("iteration "))
        arms = list(main_rows)
        check(f"{claim} arms", arms, ARMS.get(claim))
        check(f"{claim} arms of the second table", list(found[1][1]), arms)
        first = arms[0]
        for arm in arms:
            row = dict(zip(main_header, main_rows[arm]))
            done = [s for s in all_seeds if finished(s, arm, iters)]
            check(f"{claim} {arm} seeds", row["seeds"], str(len(done)))
            acc = lambda s, i: accuracy(s, arm, i)
            for i in range(iters + 1):
                check(f"{claim} {arm} iteration {i}", row[f"iteration {i}"], fmt(mean_se([acc(s, i) for s in done])))
            check(f"{claim} {arm} gain", row["gain"], fmt(mean_se([acc(s, iters) - acc(s, 0) for s in done])))
            if arm != first:
                vs = [acc(s, iters) - accuracy(s, first, iters) for s in done if finished(s, first, iters)]
                check(f"{claim} {arm} vs first", row["vs first"], fmt(mean_se(vs)))
            check(f"{claim} {arm} invalid", row["invalid at last"], fmt(mean_se([invalid(s, arm, iters) for s in done])))
            pos = [p for p in (positives(s, arm) for s in done) if p is not None]
            check(f"{claim} {arm} positives", row["positives in data (it. 1)"], fmt(mean_se(pos)))
            last = [acc(s, iters) for s in done]
            p = mean_se(last)[0]
            se_q = "–" if not last else f"{math.sqrt(p * (1 - p) / (len(last) * HELD_OUT)):.3f}"
            check(f"{claim} {arm} SE questions", row["SE questions (last)"], se_q)
        # The second table: right among given, differences over seeds and over questions.
        header, rows = found[1]
        for arm in arms:
            row = dict(zip(header, rows[arm]))
            have = [s for s in all_seeds if finished(s, arm, iters)]
            given = [accuracy(s, arm, iters) / (1 - invalid(s, arm, iters)) for s in have if invalid(s, arm, iters) < 1.0]
            check(f"{claim} {arm} right among given", row["right among given"], fmt(mean_se(given)))
            if arm == first:
                continue
            per_seed, per_question = [], []
            for s in all_seeds:
                a, b = greedy(s, arm, iters), greedy(s, first, iters)
                if a is None or b is None:
                    continue
                d = [a[q][0] - b[q][0] for q in a if q in b]
                per_seed.append(mean_se(d)[0])
                per_question.extend(d)
            check(f"{claim} {arm} − first (seeds)", row["− first (SE over seeds)"], fmt(mean_se(per_seed)))
            over_seeds, over_questions = mean_se(per_seed), mean_se(per_question)
            check(
                f"{claim} {arm} − first (questions)",
                row["− first (SE over questions)"],
                fmt(over_questions).replace(" (one seed)", ""),
            )
            check(f"{claim} {arm} larger SE", row["larger SE"], larger_se(over_seeds[1], over_questions[1]))
        # Each seed apart: greedy pass@1 (invalid) of the initial model and of each arm after
        # each iteration.
        per_seed = [(h, r) for h, r in found[2:] if len(h) > 1 and h[1] == "seed 0"]
        check(f"{claim} per-seed table", len(per_seed), 1)
        for header, rows in per_seed[:1]:
            check(f"{claim} per-seed columns", header, ["arm"] + [f"seed {s}" for s in all_seeds])
            cell = lambda s, arm, i: f"{accuracy(s, arm, i):.3f} ({invalid(s, arm, i):.3f})" if finished(s, arm, i) else "–"
            labels = ["initial model"] + [f"{arm} at iteration {i}" for arm in arms for i in range(1, iters + 1)]
            check(f"{claim} per-seed rows", list(rows), labels)
            for s in all_seeds:
                initial = next((cell(s, a, 0) for a in arms if finished(s, a, 0)), "–")
                check(f"{claim} seed {s} initial", dict(zip(header, rows["initial model"]))[f"seed {s}"], initial)
                for arm in arms:
                    for i in range(1, iters + 1):
                        row = dict(zip(header, rows[f"{arm} at iteration {i}"]))
                        check(f"{claim} seed {s} {arm} iteration {i}", row[f"seed {s}"], cell(s, arm, i))
        # Each iteration's own gain, from 2 iterations on: per seed (the seeds that have both
        # iterations), its accuracy minus the previous iteration's.
        gains = [(h, r) for h, r in found[2:] if len(h) > 1 and h[1] == "0 → 1"]
        check(f"{claim} gains table", len(gains), 1 if iters >= 2 else 0)
        for header, rows in gains:
            check(f"{claim} gains rows", list(rows), arms)
            for arm in arms:
                row = dict(zip(header, rows[arm]))
                for i in range(1, iters + 1):
                    both = [s for s in all_seeds if finished(s, arm, i) and finished(s, arm, i - 1)]
                    d = [accuracy(s, arm, i) - accuracy(s, arm, i - 1) for s in both]
                    check(f"{claim} {arm} gain {i - 1} → {i}", row[f"{i - 1} → {i}"], fmt(mean_se(d)))
        # The sampled evaluation, where the claim has one: its table is there as soon as one of
        # its arms' sampled evaluations is in the records.
        k = SAMPLED_K.get(claim)
        has_sampled = k is not None and any(
            sampled(s, a, i, k) is not None for s in all_seeds for a in arms for i in range(iters + 1)
        )
        check(f"{claim} sampled tables", sum(h[0] == "model" for h, _ in found[2:]), int(has_sampled))
        for header, rows in found[2:]:
            if header[0] != "model":
                continue
            check(f"{claim} sampled k", re.search(r"k = (\d+)", md[md.index(f"## {claim}") :]).group(1), str(k))
            measures = header[2:]

            def line(label, values, one=" (one seed)"):
                row = dict(zip(header, rows[label]))
                check(f"{claim} {label} seeds", row["seeds"], str(len(values)))
                for j, m in enumerate(measures):
                    check(f"{claim} {label} {m}", row[m], fmt(mean_se([v[j] for v in values])).replace(" (one seed)", one))

            means = lambda per_q: [mean_se([v[j] for v in per_q.values()])[0] for j in range(6)]
            runs = lambda arm, i: {s: sampled(s, arm, i, k) for s in all_seeds if sampled(s, arm, i, k) is not None}
            line("initial model", [means(r) for r in runs(first, 0).values()])
            for arm in arms:
                line(f"{arm} at iteration {iters}", [means(r) for r in runs(arm, iters).values()])
            base = runs(first, iters)
            for arm in arms[1:]:
                mine = {s: r for s, r in runs(arm, iters).items() if s in base}
                by_seed = [[x - y for x, y in zip(means(r), means(base[s]))] for s, r in mine.items()]
                by_question = [
                    [x - y for x, y in zip(r[q], base[s][q])] for s, r in mine.items() for q in r if q in base[s]
                ]
                line(f"{arm} − {first}, paired by seed", by_seed)
                row = dict(zip(header, rows[f"{arm} − {first}, paired by question"]))
                check(f"{claim} {arm} paired by question seeds", row["seeds"], str(len(mine)))
                for j, m in enumerate(measures):
                    check(
                        f"{claim} {arm} paired by question {m}",
                        row[m],
                        fmt(mean_se([v[j] for v in by_question])).replace(" (one seed)", ""),
                    )
                row = dict(zip(header, rows[f"{arm} − {first}, larger SE"]))
                check(f"{claim} {arm} larger SE seeds", row["seeds"], str(len(mine)))
                for j, m in enumerate(measures):
                    se = [mean_se([v[j] for v in d])[1] for d in (by_seed, by_question)]
                    check(f"{claim} {arm} larger SE {m}", row[m], larger_se(*se))
    for w in wrong:
        print(w)
    print(f"{checked} cells checked, {len(wrong)} differ")
    sys.exit(1 if wrong else 0)


if __name__ == "__main__":
    main()
