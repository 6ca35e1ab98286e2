//! Tasks with checkable answers: GSM8K (read from the user's JSONL files) and an embedded
//! synthetic arithmetic task, with prompt formatting, answer extraction and grading.
//!
//! The answer format follows the TOPR paper's set-up: a completion must state
//! "The answer is N"; one that does not is *invalid* (and counts as wrong). GSM8K's reference
//! solutions end with "#### N", which the extractor also reads.

use crate::tokenizer::Tokenizer;
use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// One problem: the question, a worked solution ending with the answer, and the answer.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Problem {
    pub id: String,
    pub question: String,
    /// A worked solution in the answer format ("... The answer is N.").
    pub solution: String,
    pub answer: f64,
}

/// Parses a number as people write it in answers: `1,080`, `$12.50`, `-3`, `7.`, `45%`.
pub fn parse_number(s: &str) -> Option<f64> {
    let t = s.trim().trim_start_matches('$').trim_end_matches(['.', '%', ',', ')', '*']).replace([',', '$'], "");
    if t.is_empty() || t == "-" || t == "." {
        return None;
    }
    t.parse::<f64>().ok().filter(|v| v.is_finite())
}

/// The first number in `s` (a maximal run of digits, commas, one dot, after an optional sign or `$`).
fn first_number(s: &str) -> Option<f64> {
    let bytes: Vec<char> = s.chars().collect();
    let mut i = 0;
    while i < bytes.len() {
        let c = bytes[i];
        let starts = c.is_ascii_digit()
            || ((c == '-' || c == '$' || c == '.')
                && bytes.get(i + 1).is_some_and(|n| n.is_ascii_digit() || *n == '$'));
        if starts {
            let mut j = i + 1;
            while j < bytes.len() && (bytes[j].is_ascii_digit() || matches!(bytes[j], ',' | '.' | '$')) {
                j += 1;
            }
            let text: String = bytes[i..j].iter().collect();
            if let Some(v) = parse_number(&text) {
                return Some(v);
            }
            i = j;
        } else {
            i += 1;
        }
    }
    None
}

/// The final answer of a completion: the number after the last "The answer is" (any case), or
/// else after the last "####". `None` means the completion is invalid.
pub fn extract_answer(text: &str) -> Option<f64> {
    // ASCII lowercasing keeps byte offsets, so positions index the original text.
    let lower = text.to_ascii_lowercase();
    if let Some(pos) = lower.rfind("the answer is") {
        return first_number(text[pos + "the answer is".len()..].lines().next().unwrap_or(""));
    }
    let pos = text.rfind("####")?;
    first_number(text[pos + 4..].lines().next().unwrap_or(""))
}

/// Whether a predicted answer equals the reference (relative tolerance 1e-6).
pub fn is_correct(pred: Option<f64>, reference: f64) -> bool {
    pred.is_some_and(|p| (p - reference).abs() <= 1e-6 * reference.abs().max(1.0))
}

/// GSM8K's solution with its calculator annotations removed and "#### N" turned into the answer
/// format.
fn gsm8k_solution(answer: &str, value: f64) -> String {
    let mut out = String::new();
    let mut rest = answer;
    while let Some(start) = rest.find("<<") {
        out.push_str(&rest[..start]);
        match rest[start..].find(">>") {
            Some(end) => rest = &rest[start + end + 2..],
            None => {
                rest = &rest[start..];
                break;
            }
        }
    }
    out.push_str(rest);
    let body = out.split("####").next().unwrap_or("").trim_end();
    format!("{body}\nThe answer is {}.", format_number(value))
}

/// A number as an answer is written: integers without a decimal point.
pub fn format_number(v: f64) -> String {
    if v.fract() == 0.0 && v.abs() < 1e15 { format!("{}", v as i64) } else { format!("{v}") }
}

#[derive(Deserialize)]
struct Gsm8kLine {
    question: String,
    answer: String,
}

/// Loads GSM8K problems from a JSONL file of the public release (fields `question`, `answer`).
/// A malformed line is an error naming the file and line, unless `skip_bad` is set: then it is
/// skipped and counted in the second return value.
pub fn load_gsm8k(path: &Path, skip_bad: bool) -> Result<(Vec<Problem>, usize)> {
    crate::io::refuse_device(path)?;
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut problems = vec![];
    let mut skipped = 0;
    for (n, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let parsed = serde_json::from_str::<Gsm8kLine>(line)
            .with_context(|| {
                format!("{}:{}: not a GSM8K record (needs string fields question and answer)", path.display(), n + 1)
            })
            .and_then(|r| {
                let pos = r
                    .answer
                    .rfind("####")
                    .with_context(|| format!("{}:{}: the answer has no '#### N' line", path.display(), n + 1))?;
                let value = first_number(&r.answer[pos + 4..])
                    .with_context(|| format!("{}:{}: no number after '####'", path.display(), n + 1))?;
                Ok(Problem {
                    id: format!("{}:{}", path.file_name().and_then(|f| f.to_str()).unwrap_or("gsm8k"), n + 1),
                    solution: gsm8k_solution(&r.answer, value),
                    question: r.question,
                    answer: value,
                })
            });
        match parsed {
            Ok(p) => problems.push(p),
            Err(e) if skip_bad => {
                eprintln!("skipping: {e:#}");
                skipped += 1;
            }
            Err(e) => return Err(e),
        }
    }
    if problems.is_empty() {
        bail!("{}: no problems", path.display());
    }
    Ok((problems, skipped))
}

/// The instruction appended to every question, so that answers come in the graded format.
pub const ANSWER_INSTRUCTION: &str = "Solve the problem step by step, then end with \"The answer is N.\"";

/// The user message of a problem for a chat model.
pub fn chat_message(p: &Problem) -> String {
    format!("{}\n{ANSWER_INSTRUCTION}", p.question)
}

/// A few-shot prompt for a base model: `shots` worked examples, then the question.
pub fn few_shot_prompt(shots: &[Problem], p: &Problem) -> String {
    let mut s = String::new();
    for e in shots {
        s.push_str(&format!("Question: {}\nAnswer: {}\n\n", e.question, e.solution));
    }
    s.push_str(&format!("Question: {}\nAnswer:", p.question));
    s
}

/// SplitMix64: a small seeded generator, so the synthetic task is the same on every machine.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed ^ 0x9E37_79B9_7F4A_7C15)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: i64, hi: i64) -> i64 {
        lo + (self.next_u64() % (hi - lo + 1) as u64) as i64
    }
    /// Uniform in `[0, 1)`, from the top 53 bits.
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    pub fn pick<'a, T>(&mut self, xs: &'a [T]) -> &'a T {
        &xs[self.range(0, xs.len() as i64 - 1) as usize]
    }
}

const NAMES: [&str; 8] = ["Ada", "Ben", "Cleo", "Dev", "Ema", "Finn", "Gus", "Hana"];
const ITEMS: [&str; 8] = ["apples", "marbles", "stickers", "coins", "books", "shells", "pens", "cards"];

/// A synthetic multi-step arithmetic word problem with an exact answer. `difficulty` is the
/// number of operations after the starting amount (1 = one step); numbers stay small and every
/// intermediate result non-negative, so a small model can learn the format and some of the
/// arithmetic.
pub fn synthetic_problem(rng: &mut Rng, difficulty: usize, id: usize) -> Problem {
    let name = *rng.pick(&NAMES);
    let item = *rng.pick(&ITEMS);
    let mut value = rng.range(2, 20);
    let mut question = format!("{name} has {value} {item}.");
    let mut steps = vec![format!("{name} starts with {value} {item}.")];
    for _ in 0..difficulty.max(1) {
        let op = rng.range(0, 3);
        let (text, next, work) = match op {
            0 => {
                let k = rng.range(1, 15);
                (format!(" {name} gets {k} more."), value + k, format!("{value} + {k} = {}.", value + k))
            }
            1 if value > 1 => {
                let k = rng.range(1, value - 1);
                (format!(" {name} gives away {k}."), value - k, format!("{value} - {k} = {}.", value - k))
            }
            2 => {
                let k = rng.range(2, 4);
                (
                    format!(" Then the number of {item} is multiplied by {k}."),
                    value * k,
                    format!("{value} * {k} = {}.", value * k),
                )
            }
            _ => {
                let k = rng.range(1, 9);
                (format!(" {name} finds {k} more."), value + k, format!("{value} + {k} = {}.", value + k))
            }
        };
        question.push_str(&text);
        steps.push(work);
        value = next;
    }
    question.push_str(&format!(" How many {item} does {name} have now?"));
    let solution = format!("{}\nThe answer is {value}.", steps.join(" "));
    Problem { id: format!("synthetic:{id}"), question, solution, answer: value as f64 }
}

/// A sloppy teacher's version of a worked solution: the answer line states the first number of
/// the working (the starting amount) instead of the result, a copying slip. `None` when the
/// solution has no number or no final "The answer is" line.
pub fn slipped_solution(solution: &str) -> Option<String> {
    let (working, _) = solution.rsplit_once("The answer is ")?;
    let first: String = working.split(|c: char| !c.is_ascii_digit()).find(|w| !w.is_empty())?.to_string();
    Some(format!("{working}The answer is {first}."))
}

/// `n` synthetic problems from `seed`.
pub fn synthetic_problems(seed: u64, n: usize, difficulty: usize) -> Vec<Problem> {
    let mut rng = Rng::new(seed);
    (0..n).map(|i| synthetic_problem(&mut rng, difficulty, i)).collect()
}

/// Where a task's problems come from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Source {
    /// A GSM8K JSONL file (the public release's layout).
    Gsm8k(PathBuf),
    /// `n` synthetic problems of `difficulty` operations each.
    Synthetic { n: usize, difficulty: usize },
}

/// How problems become prompts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Prompting {
    /// The model's chat template.
    Chat,
    /// `shots` worked examples before the question, read from `examples` (a GSM8K file), or
    /// generated when the task is synthetic and no file is given.
    FewShot { shots: usize, examples: Option<PathBuf> },
}

/// A task: its problems and how they are prompted.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub struct TaskSpec {
    pub source: Source,
    /// The seed of the synthetic problems, and of the worked examples and held-out problems
    /// derived from them.
    pub seed: u64,
    /// Use at most this many problems (0: all).
    pub limit: usize,
    pub prompting: Prompting,
    /// Skip malformed data lines (counted) instead of stopping at the first.
    pub skip_bad_lines: bool,
}

impl TaskSpec {
    /// `n` synthetic problems of `difficulty` from `seed`, chat prompts, no limit.
    pub fn synthetic(seed: u64, n: usize, difficulty: usize) -> Self {
        Self {
            source: Source::Synthetic { n, difficulty },
            seed,
            limit: 0,
            prompting: Prompting::Chat,
            skip_bad_lines: false,
        }
    }

    /// The problems and the prompt style.
    pub fn load(&self) -> Result<(Vec<Problem>, PromptStyle)> {
        let mut problems = match &self.source {
            Source::Gsm8k(path) => {
                let (p, skipped) = load_gsm8k(path, self.skip_bad_lines)?;
                if skipped > 0 {
                    eprintln!("skipped {skipped} malformed line(s) of {}", path.display());
                }
                p
            }
            Source::Synthetic { n, difficulty } => synthetic_problems(self.seed, *n, *difficulty),
        };
        if self.limit > 0 {
            problems.truncate(self.limit);
        }
        let style = match &self.prompting {
            Prompting::Chat => PromptStyle::Chat,
            Prompting::FewShot { shots, examples } => {
                let worked = match (examples, &self.source) {
                    (Some(p), _) => load_gsm8k(p, self.skip_bad_lines)?.0,
                    (None, Source::Synthetic { difficulty, .. }) => {
                        synthetic_problems(self.seed.wrapping_add(1_000_003), *shots, *difficulty)
                    }
                    (None, Source::Gsm8k(_)) => {
                        bail!("few-shot prompts for GSM8K need a file of worked examples (e.g. the train file)")
                    }
                };
                PromptStyle::FewShot(worked.into_iter().take(*shots).collect())
            }
        };
        Ok((problems, style))
    }
}
/// How a problem becomes a prompt.
#[derive(Clone)]
pub enum PromptStyle {
    /// The chat template with the question and the answer instruction as the user message.
    Chat,
    /// Worked examples then the question, for base models.
    FewShot(Vec<Problem>),
}

/// The token ids of `p`'s prompt in `style`.
pub fn prompt_ids(tok: &Tokenizer, style: &PromptStyle, p: &Problem) -> Result<Vec<i64>> {
    match style {
        PromptStyle::Chat => tok.prompt_ids(&chat_message(p), true),
        PromptStyle::FewShot(shots) => tok.prompt_ids(&few_shot_prompt(shots, p), false),
    }
}
/// The held-out problems of a loop or an evaluation on `task`: the first `n` of the GSM8K file
/// `file` (malformed records skipped with `skip_bad`), or else, for the synthetic task, `n`
/// synthetic problems of the task's difficulty from another seed than its training problems'.
pub fn held_out(task: &TaskSpec, file: Option<&Path>, n: usize, skip_bad: bool) -> Result<Vec<Problem>> {
    match (file, &task.source) {
        (Some(p), _) => Ok(load_gsm8k(p, skip_bad)?.0.into_iter().take(n).collect()),
        (None, Source::Synthetic { difficulty, .. }) => {
            Ok(synthetic_problems(task.seed.wrapping_add(999_983), n, *difficulty))
        }
        (None, Source::Gsm8k(_)) => bail!("GSM8K held-out questions need a file (e.g. the test file)"),
    }
}
