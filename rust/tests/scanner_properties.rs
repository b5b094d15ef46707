//! The fuzz targets' properties (`fuzz/properties.rs`) on every `cargo test`: generated log
//! lines and tails, mutated the way libFuzzer mutates (bytes flipped, inserted, removed, cut,
//! spans duplicated) from records that look like the store's, plus plain random bytes.

#[path = "../../fuzz/properties.rs"]
mod properties;

/// A small deterministic generator (no dependency, the same inputs on every run).
struct Lcg(u64);

impl Lcg {
    fn next(&mut self, below: usize) -> usize {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 33) % below.max(1) as u64) as usize
    }
}

/// A record-shaped line: a call id (sometimes odd), token arrays (sometimes repeating an
/// earlier line's), a float array, nested values.
fn record(rng: &mut Lcg, earlier: &[Vec<u64>]) -> (Vec<u64>, Vec<u8>) {
    let mut ids: Vec<u64> = match earlier.len() {
        0 => Vec::new(),
        n => earlier[rng.next(n)].clone(),
    };
    ids.truncate(rng.next(200)); // a prompt repeats a prefix of an earlier one, kept short
    ids.extend((0..rng.next(40)).map(|_| rng.next(200_000) as u64));
    let call_id = ["c1", "call \u{e9}", "", "x\u{2028}y", "7"][rng.next(5)];
    let list = |items: &[u64]| {
        items
            .iter()
            .map(u64::to_string)
            .collect::<Vec<_>>()
            .join(",")
    };
    let line = format!(
        r#"{{"generation_log_probs":[-0.5,-0.125,-0.0],"model_call_id":"{call_id}","nested":{{"a":[1,{{"b":null}}],"t":true}},"prompt_token_ids":[{}]}}"#,
        list(&ids)
    );
    (ids, line.into_bytes())
}

fn mutate(rng: &mut Lcg, bytes: &mut Vec<u8>) {
    const SPECIAL: &[u8] = b"\n\\\"{}[],:0-.eE \x00\xff\xc3";
    for _ in 0..1 + rng.next(3) {
        let mut at = rng.next(bytes.len() + 1);
        if rng.next(2) == 0 {
            // Next to structure, where grammar mistakes hide (a leading zero, a lone sign).
            at = bytes[at..]
                .iter()
                .position(|b| b",[:{".contains(b))
                .map_or(at, |i| at + i + 1);
        }
        match rng.next(6) {
            0 if at < bytes.len() => bytes[at] = SPECIAL[rng.next(SPECIAL.len())],
            1 => bytes.insert(at, SPECIAL[rng.next(SPECIAL.len())]),
            2 if at < bytes.len() => {
                bytes.remove(at);
            }
            3 => bytes.truncate(at),
            4 if at < bytes.len() => {
                let end = (at + rng.next(16)).min(bytes.len());
                let span = bytes[at..end].to_vec();
                bytes.splice(at..at, span);
            }
            _ => bytes.insert(at, rng.next(256) as u8),
        }
    }
}

#[test]
fn call_id_walk_agrees_with_a_parser_on_generated_lines() {
    let mut rng = Lcg(1);
    let mut earlier = Vec::new();
    for round in 0..40_000 {
        let (ids, mut line) = record(&mut rng, &earlier);
        earlier.push(ids);
        if earlier.len() > 8 {
            earlier.remove(0);
        }
        if round % 3 != 0 {
            mutate(&mut rng, &mut line);
        }
        if round % 50 == 0 {
            line = (0..rng.next(64)).map(|_| rng.next(256) as u8).collect();
        }
        properties::call_id_agrees_with_a_parser(&line);
    }
}

#[test]
fn tail_scan_is_exact_on_generated_tails() {
    let mut rng = Lcg(2);
    for _ in 0..3_000 {
        let mut earlier = Vec::new();
        let mut tail = Vec::new();
        for _ in 0..rng.next(6) {
            let (ids, line) = record(&mut rng, &earlier);
            earlier.push(ids);
            tail.extend_from_slice(&line);
            tail.push(b'\n');
        }
        mutate(&mut rng, &mut tail);
        properties::tail_scan_is_exact(rng.next(1 << 20) as u64, &tail);
    }
}
