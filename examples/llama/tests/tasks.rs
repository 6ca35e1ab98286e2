//! The task module of the Llama library: answer extraction on the real GSM8K files, grading,
//! and the synthetic task. GSM8K is read from `examples/llama/data/gsm8k` (or `TOPR_GSM8K_DIR`).

use std::path::PathBuf;
use topr_llama::task::*;

fn gsm8k_dir() -> PathBuf {
    std::env::var("TOPR_GSM8K_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("data/gsm8k"))
}

#[test]
fn the_extractor_recovers_every_reference_answer_of_gsm8k() {
    for (file, expected) in [("train.jsonl", 7473), ("test.jsonl", 1319)] {
        let path = gsm8k_dir().join(file);
        let text =
            std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e} (set TOPR_GSM8K_DIR)", path.display()));
        let (problems, skipped) = load_gsm8k(&path, false).unwrap();
        assert_eq!((problems.len(), skipped), (expected, 0), "{file}");
        for (line, p) in text.lines().zip(&problems) {
            let v: serde_json::Value = serde_json::from_str(line).unwrap();
            let raw = v["answer"].as_str().unwrap();
            // The "#### N" line, read independently: strip commas and parse.
            let want: f64 = raw.rsplit("####").next().unwrap().trim().replace(',', "").parse().unwrap();
            assert_eq!(p.answer, want, "{}", p.id);
            // The reference as written, and the converted solution, both extract to it.
            assert!(is_correct(extract_answer(raw), want), "{}: {raw:?}", p.id);
            assert!(is_correct(extract_answer(&p.solution), want), "{}: {:?}", p.id, p.solution);
            assert!(!p.solution.contains("<<"), "{}: calculator annotations left", p.id);
        }
    }
}

#[test]
fn answers_in_the_forms_models_write_them() {
    let cases = [
        ("So she has 5 left. The answer is 5.", Some(5.0)),
        ("the answer is $1,080.", Some(1080.0)),
        ("The answer is: 12.5 dollars", Some(12.5)),
        ("The answer is -3", Some(-3.0)),
        ("First 3+4=7. The answer is 7. Wait, the answer is 8.", Some(8.0)),
        ("#### 42", Some(42.0)),
        ("The answer is 45%.", Some(45.0)),
        ("I think it is 7.", None),
        ("The answer is unknown.", None),
        ("", None),
    ];
    for (text, want) in cases {
        assert_eq!(extract_answer(text), want, "{text:?}");
    }
    assert!(is_correct(Some(72.0), 72.0));
    assert!(!is_correct(Some(72.5), 72.0));
    assert!(!is_correct(None, 72.0));
}

#[test]
fn malformed_lines_are_named_or_skipped() {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    let path = dir.join("bad_gsm8k.jsonl");
    std::fs::write(&path, "{\"question\": \"q\", \"answer\": \"a\\n#### 3\"}\nnot json\n{\"question\": \"q\", \"answer\": \"no marker\"}\n").unwrap();
    let err = load_gsm8k(&path, false).unwrap_err();
    assert!(format!("{err:#}").contains("bad_gsm8k.jsonl:2"), "{err:#}");
    let (problems, skipped) = load_gsm8k(&path, true).unwrap();
    assert_eq!((problems.len(), skipped), (1, 2));
}

#[test]
fn synthetic_problems_are_deterministic_and_self_consistent() {
    let a = synthetic_problems(7, 200, 3);
    assert_eq!(a, synthetic_problems(7, 200, 3));
    assert_ne!(a, synthetic_problems(8, 200, 3));
    for p in &a {
        assert!(is_correct(extract_answer(&p.solution), p.answer), "{p:?}");
        assert!(p.answer >= 0.0 && p.answer.fract() == 0.0);
        // Each worked step "x op k = y." is arithmetic that holds.
        for step in p.solution.split(". ").filter(|s| s.contains(" = ")) {
            let (lhs, rhs) = step.split_once(" = ").unwrap();
            let parts: Vec<&str> = lhs.split(' ').collect();
            let (x, op, k): (i64, &str, i64) = (parts[0].parse().unwrap(), parts[1], parts[2].parse().unwrap());
            let y: i64 = rhs.split('\n').next().unwrap().trim_end_matches('.').parse().unwrap();
            assert_eq!(
                match op {
                    "+" => x + k,
                    "-" => x - k,
                    "*" => x * k,
                    _ => unreachable!(),
                },
                y,
                "{step}"
            );
        }
    }
    // Difficulty is the number of operations.
    let hard = synthetic_problems(1, 50, 5);
    assert!(hard.iter().all(|p| p.solution.matches(" = ").count() == 5));
}

#[test]
fn prompts_carry_the_answer_instruction_and_the_shots() {
    let ps = synthetic_problems(3, 3, 2);
    let chat = chat_message(&ps[2]);
    assert!(chat.starts_with(&ps[2].question) && chat.ends_with(ANSWER_INSTRUCTION));
    let fs = few_shot_prompt(&ps[..2], &ps[2]);
    assert!(fs.contains(&ps[0].solution) && fs.contains(&ps[1].solution));
    assert!(fs.ends_with(&format!("Question: {}\nAnswer:", ps[2].question)));
}

/// The sloppy teacher of the demo: its answer line repeats the starting amount, the working is
/// untouched, and the grader sees the slip.
#[test]
fn the_sloppy_teacher_copies_the_starting_amount() {
    for p in synthetic_problems(5, 200, 2) {
        let start: f64 =
            p.solution.split(|c: char| !c.is_ascii_digit()).find(|w| !w.is_empty()).unwrap().parse().unwrap();
        let slipped = slipped_solution(&p.solution).unwrap();
        let (working, _) = p.solution.rsplit_once("The answer is").unwrap();
        assert!(slipped.starts_with(working), "{slipped}");
        assert_eq!(extract_answer(&slipped), Some(start));
        assert_eq!(is_correct(extract_answer(&slipped), p.answer), start == p.answer);
    }
    assert_eq!(slipped_solution("no answer line"), None);
    // The draw that decides each slip is uniform in [0, 1).
    let mut rng = Rng::new(3);
    let u: Vec<f64> = (0..1000).map(|_| rng.uniform()).collect();
    assert!(u.iter().all(|x| (0.0..1.0).contains(x)));
    assert!((u.iter().sum::<f64>() / 1000.0 - 0.5).abs() < 0.05);
    assert_eq!(slipped_solution("The answer is 4."), None); // no number before the answer line
}
