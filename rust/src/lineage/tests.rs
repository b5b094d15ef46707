use serde_json::{json, Value};

use super::*;
use crate::store::Store;

fn user(text: &str) -> Value {
    json!({"role": "user", "content": text})
}

fn assistant(text: &str) -> Value {
    json!({"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]})
}

/// One committed call: what it saw, what it said, its tokens.
struct Turn {
    call_id: String,
    request: Vec<Value>,
    output: Value,
    prompt: Vec<u64>,
    generation: Vec<u64>,
}

impl Turn {
    fn cumulative(&self) -> Vec<u64> {
        [self.prompt.clone(), self.generation.clone()].concat()
    }

    /// The canonical-ish line of this call (serde_json sorts keys like orjson does).
    fn line(&self, parent: Option<&str>, delta_of: Option<&[u64]>) -> Vec<u8> {
        let mut all = self.request.clone();
        all.push(self.output.clone());
        let (fp, context_digest) = continuation_hashes(&all, self.request.len()).unwrap();
        let cumulative = self.cumulative();
        let prompt: Vec<u64> = match delta_of {
            Some(prefix) => self.prompt[prefix.len()..].to_vec(),
            None => self.prompt.clone(),
        };
        serde_json::to_vec(&json!({
            "schema_version": 1,
            "rollout_id": "r",
            "model_call_id": self.call_id,
            "prompt_token_ids": prompt,
            "generation_token_ids": self.generation,
            "generation_log_probs": vec![-0.5; self.generation.len()],
            "output_items": [self.output],
            "continuation_fingerprint": fp,
            "continuation_context_len": self.request.len(),
            "continuation_context_digest": context_digest,
            "fingerprint_version": 2,
            "cum_len": cumulative.len(),
            "digest": token_digest(&cumulative),
            "parent_call_id": parent,
            "parent_resolution": if parent.is_some() { "resolved" } else { "root" },
            "prompt_is_delta": delta_of.is_some(),
        }))
        .unwrap()
    }

    /// The request that continues this call.
    fn next_request(&self, text: &str) -> Vec<Value> {
        let mut next = self.request.clone();
        next.push(self.output.clone());
        next.push(user(text));
        next
    }
}

/// A conversation of `n` turns whose prompts extend the previous cumulative tokens.
fn conversation(n: usize, prefix: &str) -> Vec<Turn> {
    let mut turns: Vec<Turn> = Vec::new();
    let mut request = vec![user(&format!("{prefix} start"))];
    let mut cumulative: Vec<u64> = Vec::new();
    for i in 0..n {
        let mut prompt = cumulative.clone();
        prompt.extend((0..5).map(|j| 1000 + (i * 10 + j) as u64));
        let generation: Vec<u64> = (0..3).map(|j| 5000 + (i * 10 + j) as u64).collect();
        let turn = Turn {
            call_id: format!("{prefix}-call-{i:03}"),
            request: request.clone(),
            output: assistant(&format!("{prefix} reply {i}")),
            prompt,
            generation,
        };
        cumulative = turn.cumulative();
        request = turn.next_request(&format!("{prefix} follow-up {i}"));
        turns.push(turn);
    }
    turns
}

fn resolve_mem(lineage: &MemoryLineage, rollout: &str, items: &[Value]) -> Outcome {
    match lineage
        .resolve(rollout, &mut ItemsRequest::new(items.to_vec()))
        .unwrap()
    {
        Step::Done(outcome) => outcome,
        Step::Missing(missing) => panic!("unexpected {missing:?}"),
    }
}

fn resolve_file(lineage: &FileLineage, rollout: &str, items: &[Value]) -> Result<Outcome> {
    match lineage.resolve(rollout, &mut ItemsRequest::new(items.to_vec()))? {
        Step::Done(outcome) => Ok(outcome),
        Step::Missing(missing) => panic!("unexpected {missing:?}"),
    }
}

fn resolved(outcome: &Outcome) -> (&str, &[u64]) {
    match outcome {
        Outcome::Resolved {
            call_id, tokens, ..
        } => (call_id, tokens),
        other => panic!("expected resolved, got {other:?}"),
    }
}

fn unresolved(reason: &'static str) -> Outcome {
    Outcome::Unresolved { reason }
}

// ---- scanning --------------------------------------------------------------------------------

#[test]
fn scan_finds_the_lineage_fields_and_token_spans() {
    let line = br#"{"continuation_context_digest":"cd","continuation_context_len":3,"continuation_fingerprint":"fp","cum_len":7,"digest":"d","fingerprint_version":2,"generation_token_ids":[203],"model_call_id":"call-\"2\"","output_items":[{"content":[{"text":"]}","type":"output_text"}]}],"parent_call_id":"call-1","prompt_is_delta":true,"prompt_token_ids":[101, 102 ,103]}"#;
    let meta = scan_line(line).unwrap();
    assert_eq!(meta.call_id, "call-\"2\"");
    assert_eq!(meta.fingerprint, "fp");
    assert_eq!(meta.context_len, Some(3));
    assert_eq!(meta.context_digest, "cd");
    assert_eq!(meta.cum_len, Some(7));
    assert_eq!(meta.digest.as_deref(), Some("d"));
    assert_eq!(meta.parent_call_id.as_deref(), Some("call-1"));
    assert!(meta.prompt_is_delta);
    assert_eq!(&line[meta.prompt.clone().unwrap()], b"[101, 102 ,103]");
    assert_eq!(&line[meta.generation.clone().unwrap()], b"[203]");
    assert_eq!(meta.token_count(line), 4);
}

#[test]
fn scan_defaults_and_version_gate() {
    let meta = scan_line(br#"{"model_call_id":"a","continuation_fingerprint":"fp","fingerprint_version":1,"digest":"","continuation_context_len":-1}"#).unwrap();
    assert_eq!(meta.fingerprint, "", "only version 2 is indexed");
    assert_eq!(meta.digest, None, "an empty digest reads as absent");
    assert_eq!(meta.context_len, None, "a negative context never matches");
    let meta = scan_line(
        br#"{"model_call_id":"a","fingerprint_version":null,"cum_len":null,"parent_call_id":null}"#,
    )
    .unwrap();
    assert_eq!(meta.fingerprint, "");
    assert_eq!(meta.cum_len, None);
    assert_eq!(meta.prompt, None);
}

#[test]
fn scan_refuses_what_is_not_an_entry() {
    for bad in [
        &b""[..],
        b"[1]",
        b"{\"model_call_id\":1}",
        b"{\"x\":1}",
        b"{\"model_call_id\":\"a\"",
        b"{\"model_call_id\":\"a\"} x",
        b"{\"model_call_id\":\"a\",\"cum_len\":\"7\"}",
        b"{\"model_call_id\":\"a\",\"prompt_is_delta\":1}",
        b"{\"model_call_id\":\"a\",\"fingerprint_version\":2.0}",
        b"{\"model_call_id\":\"a\",\"p\":[1,}2]}",
        b"{\"model_call_id\":\"a\",\"p\":[1,2}",
    ] {
        assert!(scan_line(bad).is_err(), "{}", String::from_utf8_lossy(bad));
    }
}

#[test]
fn token_arrays_parse_strictly() {
    let mut out = Vec::new();
    parse_token_array(b" [ 1 , 2,3 ,18446744073709551615 ] ", &mut out).unwrap();
    assert_eq!(out, vec![1, 2, 3, u64::MAX]);
    out.clear();
    parse_token_array(b"[]", &mut out).unwrap();
    parse_token_array(b"[ ]", &mut out).unwrap();
    assert!(out.is_empty());
    parse_token_array(b"[0, 10 ,\n9999999999999999999,0]", &mut out).unwrap();
    assert_eq!(out, vec![0, 10, 9_999_999_999_999_999_999, 0]);
    for bad in [
        &b"[-1]"[..],
        b"[1.0]",
        b"[1e3]",
        b"[01]",
        b"[18446744073709551616]",
        b"[1,]",
        b"[,1]",
        b"[1] x",
        b"null",
        b"[true]",
        b"[\"1\"]",
        b"[1",
        b"[1 2]",
        b"[00]",
        b"[0 1]",
        b"[1]]",
        b"]",
        b"[123456789012345678901]",
    ] {
        assert!(
            parse_token_array(bad, &mut Vec::new()).is_err(),
            "{}",
            String::from_utf8_lossy(bad)
        );
    }
}

#[test]
fn the_fast_path_agrees_with_the_general_parser() {
    let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    for round in 0..2000 {
        let len = (next() % 40) as usize;
        let ids: Vec<u64> = (0..len)
            .map(|_| match next() % 10 {
                0 => next(),                   // up to twenty digits
                1 => next() % 10,              // one digit
                2 => 10_000_000 + next() % 10, // exactly eight digits
                _ => next() % 200_000,
            })
            .collect();
        let text = format!(
            "[{}]",
            ids.iter().map(u64::to_string).collect::<Vec<_>>().join(",")
        );
        let mut out = vec![42];
        parse_token_array(text.as_bytes(), &mut out).unwrap();
        assert_eq!(out[1..], ids[..], "round {round}: {text}");
        let mut fast = Vec::new();
        let inner = &text.as_bytes()[1..text.len() - 1];
        if parse_canonical_ids(inner, &mut fast) {
            assert_eq!(fast, ids, "{text}");
        } else {
            assert!(
                ids.is_empty() || ids.iter().any(|&id| id >= 10_000_000),
                "{text}"
            );
        }
    }
    for bad in [
        &b"1,"[..],
        b",1",
        b"1,,2",
        b"01",
        b"1 ",
        b"1,x",
        b"12345678a",
    ] {
        assert!(
            !parse_canonical_ids(bad, &mut Vec::new()),
            "{}",
            String::from_utf8_lossy(bad)
        );
    }
}

// ---- candidate rules (in memory) -------------------------------------------------------------

#[test]
fn a_conversation_resolves_turn_by_turn() {
    let lineage = MemoryLineage::new(8, 1 << 30, 1 << 20);
    let turns = conversation(6, "c");
    // The first request has no model-authored history.
    assert_eq!(resolve_mem(&lineage, "r", &turns[0].request), Outcome::Root);
    for turn in &turns {
        assert!(lineage.put("r", &turn.line(None, None)).unwrap());
        let next = turn.next_request("next");
        let outcome = resolve_mem(&lineage, "r", &next);
        let (call_id, tokens) = resolved(&outcome);
        assert_eq!(call_id, turn.call_id);
        assert_eq!(tokens, turn.cumulative().as_slice());
    }
    // The same put again is a no-op.
    assert!(!lineage.put("r", &turns[0].line(None, None)).unwrap());
}

#[test]
fn a_rewritten_or_truncated_context_is_unresolved() {
    let lineage = MemoryLineage::new(8, 1 << 30, 1 << 20);
    let turns = conversation(3, "c");
    for turn in &turns {
        lineage.put("r", &turn.line(None, None)).unwrap();
    }
    let mut rewritten = turns[2].next_request("x");
    rewritten[0] = user("a different first message");
    assert_eq!(
        resolve_mem(&lineage, "r", &rewritten),
        unresolved(REASON_NO_MATCH)
    );
    // Dropping the context the call saw: the fingerprint still matches, the context cannot.
    let full = turns[2].next_request("x");
    let truncated: Vec<Value> = full[full.len() - 3..].to_vec();
    assert_eq!(
        resolve_mem(&lineage, "r", &truncated),
        unresolved(REASON_NO_MATCH)
    );
    assert_eq!(
        resolve_mem(&lineage, "other", &full),
        unresolved(REASON_NO_MATCH)
    );
}

#[test]
fn same_output_different_tokens_is_ambiguous_and_identical_retries_collapse() {
    let turns = conversation(1, "c");
    let first = &turns[0];
    let twin = Turn {
        call_id: "c-call-twin".into(),
        request: first.request.clone(),
        output: first.output.clone(),
        prompt: first.prompt.clone(),
        generation: vec![7, 7, 7],
    };
    let retry = Turn {
        call_id: "a-retry".into(),
        request: first.request.clone(),
        output: first.output.clone(),
        prompt: first.prompt.clone(),
        generation: first.generation.clone(),
    };
    let next = first.next_request("n");

    let lineage = MemoryLineage::new(8, 1 << 30, 1 << 20);
    lineage.put("r", &first.line(None, None)).unwrap();
    lineage.put("r", &twin.line(None, None)).unwrap();
    assert_eq!(
        resolve_mem(&lineage, "r", &next),
        unresolved(REASON_AMBIGUOUS)
    );

    let lineage = MemoryLineage::new(8, 1 << 30, 1 << 20);
    lineage.put("r", &first.line(None, None)).unwrap();
    lineage.put("r", &retry.line(None, None)).unwrap();
    let outcome = resolve_mem(&lineage, "r", &next);
    assert_eq!(resolved(&outcome).0, "a-retry", "the smallest call id wins");
}

#[test]
fn a_conflicting_payload_counts_as_zero_candidates() {
    let lineage = MemoryLineage::new(8, 1 << 30, 1 << 20);
    let turns = conversation(1, "c");
    lineage.put("r", &turns[0].line(None, None)).unwrap();
    let mut other = turns[0].line(None, None);
    other.extend_from_slice(b" ");
    assert!(matches!(
        lineage.put("r", &other),
        Err(LineageError::Store(Error::Conflict { .. }))
    ));
    assert_eq!(
        resolve_mem(&lineage, "r", &turns[0].next_request("n")),
        unresolved(REASON_NO_MATCH)
    );
}

#[test]
fn an_empty_recorded_context_digest_never_matches() {
    let lineage = MemoryLineage::new(8, 1 << 30, 1 << 20);
    let turns = conversation(1, "c");
    let mut value: Value = serde_json::from_slice(&turns[0].line(None, None)).unwrap();
    value["continuation_context_digest"] = json!("");
    lineage
        .put("r", &serde_json::to_vec(&value).unwrap())
        .unwrap();
    assert_eq!(
        resolve_mem(&lineage, "r", &turns[0].next_request("n")),
        unresolved(REASON_NO_MATCH)
    );
}

#[test]
fn hashed_requests_ask_for_the_digests_they_need() {
    let lineage = MemoryLineage::new(8, 1 << 30, 1 << 20);
    let turns = conversation(2, "c");
    for turn in &turns {
        lineage.put("r", &turn.line(None, None)).unwrap();
    }
    let next = turns[1].next_request("n");
    let fp = fingerprint::assistant_fingerprint(&next).unwrap();
    let mut request = HashedRequest {
        fingerprint: fp,
        len: next.len(),
        digests: HashMap::new(),
    };
    let step = lineage.resolve("r", &mut request).unwrap();
    assert_eq!(step, Step::Missing(Missing::Need(vec![3])));
    request
        .digests
        .insert(3, fingerprint::conversation_digest(&next[..3]).unwrap());
    match lineage.resolve("r", &mut request).unwrap() {
        Step::Done(outcome) => assert_eq!(resolved(&outcome).0, turns[1].call_id),
        other => panic!("{other:?}"),
    }
}

// ---- materialization -------------------------------------------------------------------------

#[test]
fn a_fifty_link_delta_chain_rebuilds_the_full_prompts() {
    let turns = conversation(50, "d");
    let full = MemoryLineage::new(8, 1 << 30, 0);
    let delta = MemoryLineage::new(8, 1 << 30, 0);
    let mut parent: Option<&Turn> = None;
    for turn in &turns {
        full.put("r", &turn.line(None, None)).unwrap();
        let parent_cumulative = parent.map(Turn::cumulative);
        delta
            .put(
                "r",
                &turn.line(
                    parent.map(|p| p.call_id.as_str()),
                    parent_cumulative.as_deref(),
                ),
            )
            .unwrap();
        parent = Some(turn);
    }
    let next = turns[49].next_request("n");
    let a = resolve_mem(&full, "r", &next);
    let b = resolve_mem(&delta, "r", &next);
    assert_eq!(a, b);
    assert_eq!(resolved(&b).1, turns[49].cumulative().as_slice());
    // Every earlier link resolves too (no cache: each walk goes back to the root).
    for turn in &turns[..49] {
        let outcome = resolve_mem(&delta, "r", &turn.next_request("n"));
        assert_eq!(resolved(&outcome).1, turn.cumulative().as_slice());
    }
}

#[test]
fn cached_ancestors_shorten_the_walk_and_answers_stay_verified() {
    let turns = conversation(10, "d");
    let lineage = MemoryLineage::new(8, 1 << 30, 1 << 20);
    let mut parent: Option<&Turn> = None;
    for turn in &turns {
        let parent_cumulative = parent.map(Turn::cumulative);
        lineage
            .put(
                "r",
                &turn.line(
                    parent.map(|p| p.call_id.as_str()),
                    parent_cumulative.as_deref(),
                ),
            )
            .unwrap();
        let outcome = resolve_mem(&lineage, "r", &turn.next_request("n"));
        assert_eq!(resolved(&outcome).1, turn.cumulative().as_slice());
        parent = Some(turn);
    }
    assert!(lineage.cached_tokens() > 0);
    // A repeat is served from the cache: same tokens, same allocation.
    let next = turns[9].next_request("n");
    let (Outcome::Resolved { tokens: a, .. }, Outcome::Resolved { tokens: b, .. }) = (
        resolve_mem(&lineage, "r", &next),
        resolve_mem(&lineage, "r", &next),
    ) else {
        panic!("expected resolved");
    };
    assert!(Arc::ptr_eq(&a, &b));
}

#[test]
fn a_full_prompt_extending_its_cached_parent_is_parsed_from_the_new_turn_on() {
    // Resolving in order caches each parent; the next winner reuses it. A winner whose prompt
    // re-tokenizes the parent's tokens (same length, different ids; or shorter) must still
    // come back exactly.
    let mut turns = conversation(6, "p");
    turns[3].prompt[1] += 1; // diverges inside the parent's span
    turns[4].prompt = turns[4].prompt[..3].to_vec(); // shorter than its parent
    let lineage = MemoryLineage::new(8, 1 << 30, 1 << 20);
    let mut parent: Option<String> = None;
    for turn in &turns {
        lineage
            .put("r", &turn.line(parent.as_deref(), None))
            .unwrap();
        parent = Some(turn.call_id.clone());
    }
    for turn in &turns {
        let outcome = resolve_mem(&lineage, "r", &turn.next_request("n"));
        assert_eq!(
            resolved(&outcome).1,
            turn.cumulative().as_slice(),
            "{}",
            turn.call_id
        );
    }
    // A parent whose cached tokens are the winner's whole prompt (an empty new turn).
    let mut twin = conversation(2, "q");
    twin[1].prompt = twin[0].cumulative();
    let lineage = MemoryLineage::new(8, 1 << 30, 1 << 20);
    lineage.put("r", &twin[0].line(None, None)).unwrap();
    lineage
        .put("r", &twin[1].line(Some(&twin[0].call_id), None))
        .unwrap();
    for turn in &twin {
        let outcome = resolve_mem(&lineage, "r", &turn.next_request("n"));
        assert_eq!(resolved(&outcome).1, turn.cumulative().as_slice());
    }
}

fn corrupted(
    turn: &Turn,
    parent: Option<&str>,
    delta_of: Option<&[u64]>,
    edit: impl Fn(&mut Value),
) -> Vec<u8> {
    let mut value: Value = serde_json::from_slice(&turn.line(parent, delta_of)).unwrap();
    edit(&mut value);
    serde_json::to_vec(&value).unwrap()
}

#[test]
fn integrity_failures_raise_never_answer() {
    let turns = conversation(3, "i");
    let c0 = turns[0].cumulative();
    let c1 = turns[1].cumulative();
    let cases: Vec<(&str, Vec<Vec<u8>>)> = vec![
        (
            "digest",
            vec![corrupted(&turns[0], None, None, |v| {
                v["digest"] = json!(token_digest(&[1, 2, 3]))
            })],
        ),
        (
            "cum_len",
            vec![corrupted(&turns[0], None, None, |v| {
                v["cum_len"] = json!(3)
            })],
        ),
        ("parent", vec![turns[1].line(Some("nobody"), Some(&c0))]),
        (
            "cycle",
            vec![
                turns[0].line(Some(&turns[1].call_id), Some(&[])),
                turns[1].line(Some(&turns[0].call_id), Some(&c0)),
            ],
        ),
        (
            "no parent id",
            vec![corrupted(&turns[0], None, Some(&[]), |v| {
                v["parent_resolution"] = json!("resolved")
            })],
        ),
        (
            "token array",
            vec![corrupted(&turns[0], None, None, |v| {
                v["generation_token_ids"] = json!([1, -2])
            })],
        ),
        (
            "missing array",
            vec![corrupted(&turns[0], None, None, |v| {
                v.as_object_mut().unwrap().remove("prompt_token_ids");
            })],
        ),
    ];
    let _ = c1;
    for (name, lines) in cases {
        let lineage = MemoryLineage::new(8, 1 << 30, 1 << 20);
        for line in &lines {
            lineage.put("r", line).unwrap();
        }
        let winner = if name == "cycle" || name == "parent" {
            1
        } else {
            0
        };
        let result = lineage.resolve("r", &mut ItemsRequest::new(turns[winner].next_request("n")));
        assert!(
            matches!(result, Err(LineageError::Integrity(_))),
            "{name}: {result:?}"
        );
    }
}

/// An entry that records no digest still resolves with its full prompt rebuilt; the match
/// carries the digest it records, "" (as NeMo Gym's resolvers answer), not the computed one.
#[test]
fn an_unstamped_entry_resolves_to_its_rebuilt_tokens_with_no_digest() {
    let turns = conversation(1, "u");
    let lineage = MemoryLineage::new(8, 1 << 30, 1 << 20);
    lineage
        .put(
            "r",
            &corrupted(&turns[0], None, None, |v| {
                v["digest"] = Value::Null;
                v["cum_len"] = Value::Null;
            }),
        )
        .unwrap();
    let outcome = resolve_mem(&lineage, "r", &turns[0].next_request("n"));
    let Outcome::Resolved { digest, tokens, .. } = outcome else {
        panic!("expected resolved");
    };
    assert_eq!(*tokens, turns[0].cumulative());
    assert_eq!(digest, "");
}

// ---- memory bounds ---------------------------------------------------------------------------

#[test]
fn memory_eviction_is_lru_by_tokens_and_never_the_only_rollout() {
    let turns = conversation(4, "m");
    let per_line = |turn: &Turn| (turn.prompt.len() + turn.generation.len()) as u64;
    let lineage = MemoryLineage::new(8, per_line(&turns[0]), 0);
    // A single rollout larger than the budget is kept whole.
    for turn in &turns {
        lineage.put("big", &turn.line(None, None)).unwrap();
    }
    assert_eq!(lineage.rollout_count(), 1);
    let next = turns[3].next_request("n");
    assert_eq!(
        resolved(&resolve_mem(&lineage, "big", &next)).0,
        turns[3].call_id
    );
    // Another rollout pushes it out.
    lineage.put("small", &turns[0].line(None, None)).unwrap();
    assert_eq!(lineage.rollout_count(), 1);
    assert_eq!(
        resolve_mem(&lineage, "big", &next),
        unresolved(REASON_NO_MATCH)
    );
    assert_eq!(lineage.stored_tokens(), per_line(&turns[0]));

    let lineage = MemoryLineage::new(2, 1 << 30, 0);
    for rollout in ["a", "b", "c"] {
        lineage.put(rollout, &turns[0].line(None, None)).unwrap();
    }
    assert_eq!(lineage.rollout_count(), 2);
    let (removed, absent) = lineage.delete(&["a", "b", "c"]).unwrap();
    assert_eq!(
        (removed, absent),
        (vec!["b".into(), "c".into()], vec!["a".to_string()])
    );
    assert_eq!(lineage.stored_tokens(), 0);
}

#[test]
fn token_cache_evicts_by_tokens() {
    let cache = TokenCache::new(10);
    cache.insert("a".into(), Arc::new(vec![1u64; 6]));
    cache.insert("b".into(), Arc::new(vec![2u64; 4]));
    assert_eq!(cache.tokens(), 10);
    assert!(cache.get("a").is_some()); // a is now the most recent
    cache.insert("c".into(), Arc::new(vec![3u64; 3]));
    assert!(cache.get("b").is_none());
    assert_eq!(cache.tokens(), 9);
    cache.insert("huge".into(), Arc::new(vec![0u64; 11]));
    assert!(cache.get("huge").is_none());
}

// ---- files -----------------------------------------------------------------------------------

#[test]
fn file_lineage_sees_every_put_and_reads_incrementally() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path(), 8).unwrap();
    let lineage = FileLineage::new(dir.path(), 8, 1 << 20);
    let turns = conversation(5, "f");
    // Nothing on disk: no match, and reading created nothing.
    assert_eq!(
        resolve_file(&lineage, "r", &turns[0].next_request("n")).unwrap(),
        unresolved(REASON_NO_MATCH)
    );
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    for turn in &turns {
        store
            .put("r", &turn.call_id, &turn.line(None, None))
            .unwrap();
        let outcome = resolve_file(&lineage, "r", &turn.next_request("n")).unwrap();
        assert_eq!(resolved(&outcome).1, turn.cumulative().as_slice());
    }
    // A torn final line is ignored until it is completed.
    let log = dir.path().join("r.tokens.jsonl");
    let extra = conversation(1, "g");
    let line = extra[0].line(None, None);
    {
        use std::io::Write;
        let mut file = OpenOptions::new().append(true).open(&log).unwrap();
        file.write_all(&line[..line.len() / 2]).unwrap();
        let next = extra[0].next_request("n");
        assert_eq!(
            resolve_file(&lineage, "r", &next).unwrap(),
            unresolved(REASON_NO_MATCH)
        );
        file.write_all(&line[line.len() / 2..]).unwrap();
        file.write_all(b"\n").unwrap();
        assert_eq!(
            resolved(&resolve_file(&lineage, "r", &next).unwrap()).0,
            extra[0].call_id
        );
    }
}

#[test]
fn file_lineage_resets_on_delete_replace_and_truncate() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path(), 8).unwrap();
    let lineage = FileLineage::new(dir.path(), 8, 1 << 20);
    let old = conversation(3, "old");
    let new = conversation(3, "new");
    for turn in &old {
        store
            .put("r", &turn.call_id, &turn.line(None, None))
            .unwrap();
    }
    let old_next = old[2].next_request("n");
    assert_eq!(
        resolved(&resolve_file(&lineage, "r", &old_next).unwrap()).0,
        old[2].call_id
    );

    // Retire: the records go, nothing resolves.
    store.retire(&["r"]).unwrap();
    assert_eq!(
        resolve_file(&lineage, "r", &old_next).unwrap(),
        unresolved(REASON_NO_MATCH)
    );
    // Delete and reuse: only the new entries resolve (same call ids, different content).
    store.delete(&["r"]).unwrap();
    for (turn, old_turn) in new.iter().zip(&old) {
        let reused = Turn {
            call_id: old_turn.call_id.clone(),
            request: turn.request.clone(),
            output: turn.output.clone(),
            prompt: turn.prompt.clone(),
            generation: turn.generation.iter().map(|t| t + 1).collect(),
        };
        store
            .put("r", &reused.call_id, &reused.line(None, None))
            .unwrap();
    }
    assert_eq!(
        resolve_file(&lineage, "r", &old_next).unwrap(),
        unresolved(REASON_NO_MATCH)
    );
    let outcome = resolve_file(&lineage, "r", &new[2].next_request("n")).unwrap();
    assert_eq!(resolved(&outcome).0, old[2].call_id);
    assert_eq!(
        resolved(&outcome).1[..new[2].prompt.len()],
        new[2].prompt[..]
    );

    // Replaced by rename: a different inode resets the index.
    let log = dir.path().join("r.tokens.jsonl");
    let replacement = dir.path().join("replacement");
    std::fs::write(
        &replacement,
        [old[0].line(None, None), b"\n".to_vec()].concat(),
    )
    .unwrap();
    std::fs::rename(&replacement, &log).unwrap();
    assert_eq!(
        resolved(&resolve_file(&lineage, "r", &old[0].next_request("n")).unwrap()).0,
        old[0].call_id
    );
    assert_eq!(
        resolve_file(&lineage, "r", &new[2].next_request("n")).unwrap(),
        unresolved(REASON_NO_MATCH)
    );

    // Truncated in place below the cursor: read again from the start.
    let file = OpenOptions::new().write(true).open(&log).unwrap();
    file.set_len(0).unwrap();
    assert_eq!(
        resolve_file(&lineage, "r", &old[0].next_request("n")).unwrap(),
        unresolved(REASON_NO_MATCH)
    );
    let append = |line: Vec<u8>| {
        use std::io::Write;
        let mut file = OpenOptions::new().append(true).open(&log).unwrap();
        file.write_all(&[line, b"\n".to_vec()].concat()).unwrap();
    };
    append(old[1].line(None, None));
    assert_eq!(
        resolved(&resolve_file(&lineage, "r", &old[1].next_request("n")).unwrap()).0,
        old[1].call_id
    );
    // Rewritten in place with longer content: the cursor no longer ends a line, so the
    // index starts over instead of parsing from the middle of a line.
    file.set_len(0).unwrap();
    append(old[2].line(None, None));
    assert_eq!(
        resolved(&resolve_file(&lineage, "r", &old[2].next_request("n")).unwrap()).0,
        old[2].call_id
    );
    assert_eq!(
        resolve_file(&lineage, "r", &old[1].next_request("n")).unwrap(),
        unresolved(REASON_NO_MATCH)
    );
}

#[test]
fn file_lineage_conflicting_lines_count_as_zero_candidates() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("r.tokens.jsonl");
    let turns = conversation(2, "x");
    let first = turns[0].line(None, None);
    let mut conflicting: Value = serde_json::from_slice(&first).unwrap();
    conflicting["created_at"] = json!(5);
    let lines = [
        first.clone(),
        first.clone(), // an identical copy is a duplicate, not a conflict
        turns[1].line(None, None),
    ];
    std::fs::write(&log, lines.map(|l| [l, b"\n".to_vec()].concat()).concat()).unwrap();
    let lineage = FileLineage::new(dir.path(), 8, 1 << 20);
    let next = turns[0].next_request("n");
    assert_eq!(
        resolved(&resolve_file(&lineage, "r", &next).unwrap()).0,
        turns[0].call_id
    );
    {
        use std::io::Write;
        let mut file = OpenOptions::new().append(true).open(&log).unwrap();
        file.write_all(&serde_json::to_vec(&conflicting).unwrap())
            .unwrap();
        file.write_all(b"\n").unwrap();
    }
    assert_eq!(
        resolve_file(&lineage, "r", &next).unwrap(),
        unresolved(REASON_NO_MATCH)
    );
    // The other call is unaffected.
    let outcome = resolve_file(&lineage, "r", &turns[1].next_request("n")).unwrap();
    assert_eq!(resolved(&outcome).0, turns[1].call_id);
}

#[test]
fn a_corrupt_line_raises_with_its_offset() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("r.tokens.jsonl");
    let turns = conversation(1, "x");
    let first = turns[0].line(None, None);
    std::fs::write(&log, [first.clone(), b"\nnot json\n".to_vec()].concat()).unwrap();
    let lineage = FileLineage::new(dir.path(), 8, 1 << 20);
    match resolve_file(&lineage, "r", &turns[0].next_request("n")) {
        Err(LineageError::Store(Error::Corrupt { offset, .. })) => {
            assert_eq!(offset, first.len() as u64 + 1)
        }
        other => panic!("{other:?}"),
    }
    // Roots never touch the files.
    assert_eq!(
        resolve_file(&lineage, "r", &[user("hi")]).unwrap(),
        Outcome::Root
    );
    assert!(lineage
        .resolve("bad/id", &mut ItemsRequest::new(vec![]))
        .is_err());
}

/// A log of `turns` (full prompts) with "not json" lines inserted before the lines at
/// `bad_before`; its bytes and the offset of each bad line.
fn log_with_bad_lines(turns: &[Turn], bad_before: &[usize]) -> (Vec<u8>, Vec<u64>) {
    let mut log = Vec::new();
    let mut bad = Vec::new();
    for (i, turn) in turns.iter().enumerate() {
        if bad_before.contains(&i) {
            bad.push(log.len() as u64);
            log.extend_from_slice(b"not json\n");
        }
        log.extend_from_slice(&turn.line(None, None));
        log.push(b'\n');
    }
    (log, bad)
}

#[test]
fn a_large_log_reports_its_first_corrupt_line_and_resolves_from_any_window() {
    const MIB: usize = 1 << 20;
    let turns = conversation(300, "big");
    let (whole, _) = log_with_bad_lines(&turns, &[]);
    assert!(whole.len() > MIB, "the log must be split: {}", whole.len());
    let last = turns.len() - 1;
    // One bad line late in the log, then one early and one late: the refusal names the first
    // in file order.
    for bad_before in [vec![last - 5], vec![40, last - 5]] {
        let dir = tempfile::tempdir().unwrap();
        let (log, bad) = log_with_bad_lines(&turns, &bad_before);
        std::fs::write(dir.path().join("r.tokens.jsonl"), &log).unwrap();
        // Scanned on one thread, and on two (the log split at its middle: the first bad line
        // in one half or the other, or one in each).
        for split_at in [usize::MAX, 1] {
            let lineage =
                FileLineage::new(dir.path(), 8, 1 << 20).with_split_scan_at_least(split_at);
            match resolve_file(&lineage, "r", &turns[last].next_request("n")) {
                Err(LineageError::Store(Error::Corrupt { offset, .. })) => {
                    assert_eq!(offset, bad[0], "bad lines at {bad:?}, split at {split_at}")
                }
                other => panic!("{other:?}"),
            }
        }
    }
    // Whole, every call resolves to its own tokens, from one window and from windows that
    // split the log anywhere.
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("r.tokens.jsonl"), &whole).unwrap();
    for (window, split_at) in [
        (whole.len(), usize::MAX),
        (MIB + 12_345, usize::MAX),
        (whole.len(), 1),
    ] {
        for turn in [&turns[0], &turns[150], &turns[last]] {
            let lineage = FileLineage::new(dir.path(), 8, 0)
                .with_read_window(window)
                .with_split_scan_at_least(split_at);
            let outcome = resolve_file(&lineage, "r", &turn.next_request("n")).unwrap();
            assert_eq!(resolved(&outcome).0, turn.call_id, "window {window}");
            assert_eq!(resolved(&outcome).1, turn.cumulative().as_slice());
        }
    }
}

#[test]
fn small_read_windows_fold_the_same_lines() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path(), 8).unwrap();
    let turns = conversation(6, "w");
    for turn in &turns {
        store
            .put("r", &turn.call_id, &turn.line(None, None))
            .unwrap();
    }
    // Windows smaller than one line, about one line, and several lines.
    for window in [1, 700, 5000] {
        let lineage = FileLineage::new(dir.path(), 8, 0).with_read_window(window);
        for turn in &turns {
            let outcome = resolve_file(&lineage, "r", &turn.next_request("n")).unwrap();
            assert_eq!(
                resolved(&outcome).1,
                turn.cumulative().as_slice(),
                "window {window}"
            );
        }
    }
}

#[test]
fn file_lineage_lru_bounds_rollouts() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path(), 8).unwrap();
    let lineage = FileLineage::new(dir.path(), 2, 1 << 20);
    let turns = conversation(1, "l");
    for rollout in ["a", "b", "c"] {
        store
            .put(rollout, &turns[0].call_id, &turns[0].line(None, None))
            .unwrap();
        let outcome = resolve_file(&lineage, rollout, &turns[0].next_request("n")).unwrap();
        assert_eq!(resolved(&outcome).0, turns[0].call_id);
    }
    assert_eq!(lineage.cached_rollouts(), 2);
    // An evicted rollout is simply read again.
    let outcome = resolve_file(&lineage, "a", &turns[0].next_request("n")).unwrap();
    assert_eq!(resolved(&outcome).0, turns[0].call_id);
    lineage.clear();
    assert_eq!((lineage.cached_rollouts(), lineage.cached_tokens()), (0, 0));
}

#[test]
fn nth_comma_finds_separators_across_blocks() {
    let text: Vec<u8> = (0..3000u32)
        .map(|i| i.to_string())
        .collect::<Vec<_>>()
        .join(",")
        .into_bytes();
    let positions: Vec<usize> = memchr::memchr_iter(b',', &text).collect();
    for n in [0, 1, 100, 511, 512, 1500, positions.len() - 1] {
        assert_eq!(nth_comma(&text, n), Ok(positions[n]));
    }
    assert_eq!(nth_comma(&text, positions.len()), Err(positions.len()));
    assert_eq!(nth_comma(b"", 0), Err(0));
}

#[test]
fn comma_counts_survive_runs_of_nothing_but_commas() {
    // The byte-wide counters hold at most 255: a run of commas longer than that must not wrap.
    assert_eq!(count_commas(&[b','; 255]), 255);
    assert_eq!(count_commas(&[b','; 256]), 256);
    assert_eq!(count_commas(&[b','; 600]), 600);
    assert_eq!(count_commas(b""), 0);
    assert_eq!(count_commas(b"1,22,333"), 2);
    let mut mixed = vec![b'7'; 1000];
    for at in [0, 254, 255, 256, 510, 511, 999] {
        mixed[at] = b',';
    }
    assert_eq!(count_commas(&mixed), 7);
    // All commas: the n-th is at n, in and past the first 512-byte block.
    let commas = [b','; 1300];
    for n in [0, 254, 255, 511, 512, 1299] {
        assert_eq!(nth_comma(&commas, n), Ok(n));
    }
    assert_eq!(nth_comma(&commas, 1300), Err(1300));
}

#[test]
fn extends_is_a_prefix_check() {
    assert!(extends(&[], &[]));
    assert!(extends(&[1, 2], &[1, 2]));
    assert!(extends(&[1, 2], &[1, 2, 3]));
    assert!(!extends(&[1, 2], &[1]));
    assert!(!extends(&[1, 2], &[1, 3, 2]));
}

// ---- the mapped read and the one-pass array skip against the paths they replace ------------

/// `skip_value`'s flat-array test before `first_structural`: the first `]`, then no `[`, `{`,
/// `"` or `}` before it (three passes).
fn flat_end_by_three_passes(buf: &[u8], pos: usize) -> Option<usize> {
    let close = memchr::memchr(b']', &buf[pos + 1..])?;
    let inner = &buf[pos + 1..pos + 1 + close];
    (memchr::memchr3(b'[', b'{', b'"', inner).is_none() && memchr::memchr(b'}', inner).is_none())
        .then_some(pos + close + 2)
}

/// A small deterministic generator (xorshift64*), so failures reproduce.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

#[test]
fn first_structural_agrees_with_the_three_pass_flat_array_test() {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    // Mostly digits and commas (token arrays), with the structural bytes, their bit-5 twins
    // (`;`, `=`, `{`/`[` pairs differ in bit 5 only) and a few others sprinkled at any place,
    // including across and at the edges of the 64-byte blocks.
    let alphabet = b"0123456789,,,,,,[]{}\";=;=-. \n\x02\x7f\xdb\xfd";
    for case in 0..20_000 {
        let len = 1 + rng.below(if case % 2 == 0 { 70 } else { 300 });
        let mut buf = vec![b'['];
        for _ in 0..len {
            buf.push(if rng.below(12) == 0 {
                alphabet[10 + rng.below(alphabet.len() - 10)]
            } else {
                alphabet[rng.below(11)]
            });
        }
        let fast = first_structural::<false>(&buf[1..])
            .filter(|&at| buf[1 + at] == b']')
            .map(|at| at + 2);
        assert_eq!(fast, flat_end_by_three_passes(&buf, 0), "{:?}", buf);
        // And the whole value skip is the reference's (fast answer or the bracket walk).
        let reference = match flat_end_by_three_passes(&buf, 0) {
            Some(end) => Ok(end),
            None => skip_container::<false>(&buf, 0),
        };
        assert_eq!(skip_value::<false>(&buf, 0), reference, "{:?}", buf);
    }
}

/// Every answer (or error) of a fresh resolver over the log of rollout `r` in `dir`, for every
/// request of `requests`, read by `pread` windows of `window` bytes or through a map, each
/// chunk scanned on one thread or (`split`) on two.
fn answers(
    dir: &std::path::Path,
    requests: &[Vec<Value>],
    mapped: bool,
    window: usize,
    split: bool,
) -> Vec<String> {
    let map_at = if mapped { 1 } else { u64::MAX };
    let split_at = if split { 1 } else { usize::MAX };
    requests
        .iter()
        .map(|request| {
            let lineage = FileLineage::new(dir, 8, 1 << 20)
                .with_read_window(window)
                .with_map_at_least(map_at)
                .with_split_scan_at_least(split_at);
            format!("{:?}", resolve_file(&lineage, "r", request))
        })
        .collect()
}

#[test]
fn mapped_reads_answer_as_pread_reads_on_damaged_forked_and_duplicated_logs() {
    let mut rng = Rng(0x51_7cc1_b727_220a);
    let turns = conversation(12, "m");
    let fork = Turn {
        call_id: "m-call-fork".into(),
        request: turns[5].request.clone(),
        output: turns[5].output.clone(),
        prompt: turns[5].prompt.clone(),
        generation: vec![9, 9, 9],
    };
    let unstamped = {
        let mut line: Value = serde_json::from_slice(&turns[8].line(None, None)).unwrap();
        line["fingerprint_version"] = json!(1);
        line["model_call_id"] = json!("m-call-masked");
        serde_json::to_vec(&line).unwrap()
    };
    let mut requests: Vec<Vec<Value>> = turns.iter().map(|t| t.next_request("n")).collect();
    requests.push(vec![user("a root")]);
    requests.push(vec![user("x"), assistant("never said")]);
    // Whole lines: full prompts, a delta chain, a fork (ambiguous), an identical retry, a
    // conflicting repeat, an unstamped line.
    let mut lines: Vec<Vec<u8>> = Vec::new();
    for (i, turn) in turns.iter().enumerate() {
        let line = if (3..7).contains(&i) {
            turn.line(
                Some(&turns[i - 1].call_id),
                Some(&turns[i - 1].cumulative()),
            )
        } else {
            turn.line(None, None)
        };
        lines.push(line);
    }
    lines.push(fork.line(None, None));
    lines.push(turns[1].line(None, None)); // an identical retry of one call id
    let mut conflicting = turns[9].line(None, None);
    conflicting.push(b' ');
    lines.push(conflicting);
    lines.push(unstamped);
    let mut outcomes: Vec<String> = Vec::new();
    for case in 0..120 {
        let mut order = lines.clone();
        // Shuffle a little: lines move, never the parents of deltas past their children.
        if case % 3 == 1 {
            let (a, b) = (
                7 + rng.below(order.len() - 7),
                7 + rng.below(order.len() - 7),
            );
            order.swap(a, b);
        }
        let mut log: Vec<u8> = order
            .iter()
            .flat_map(|l| [&l[..], b"\n"].concat())
            .collect();
        match case % 6 {
            0 => {} // whole
            1 => {
                // A flipped byte anywhere (in a token array, a key, a digest, a newline).
                let at = rng.below(log.len());
                log[at] = b"0123456789,[]{}\"x \n"[rng.below(19)];
            }
            2 => log.truncate(rng.below(log.len() + 1)), // torn anywhere
            3 => {
                // A line cut short inside the log, then more lines.
                let at = rng.below(log.len());
                log.insert(at, b'\n');
            }
            4 => {
                let at = rng.below(log.len());
                log.splice(at..at, b"not json\n".iter().copied());
            }
            _ => {
                let (from, to) = (rng.below(log.len()), rng.below(log.len()));
                log.drain(from.min(to)..from.max(to)); // a hole
            }
        }
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("r.tokens.lock"), b"").unwrap();
        std::fs::write(dir.path().join("r.tokens.jsonl"), &log).unwrap();
        let pread = answers(dir.path(), &requests, false, 1 << 20, false);
        assert_eq!(
            answers(dir.path(), &requests, true, 1 << 20, false),
            pread,
            "case {case}"
        );
        assert_eq!(
            answers(dir.path(), &requests, false, 97, false),
            pread,
            "case {case}"
        );
        // Each chunk's lines scanned by two threads, split at the first line past its middle.
        for mapped in [false, true] {
            assert_eq!(
                answers(dir.path(), &requests, mapped, 1 << 20, true),
                pread,
                "case {case}, split, mapped {mapped}"
            );
        }
        outcomes.extend(pread);
    }
    // The cases reach every kind of answer.
    for kind in [
        "Ok(Resolved",
        "Ok(Root)",
        "no_match",
        "ambiguous",
        "Corrupt",
        "Integrity",
    ] {
        assert!(
            outcomes.iter().any(|o| o.contains(kind)),
            "no {kind} answer"
        );
    }
}

#[test]
fn a_mapped_look_continues_from_any_cursor() {
    // The second look maps from a cursor inside a page; every later line is folded once.
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("r.tokens.lock"), b"").unwrap();
    let log = dir.path().join("r.tokens.jsonl");
    let turns = conversation(40, "c");
    let lineage = FileLineage::new(dir.path(), 8, 1 << 20).with_map_at_least(1);
    let mut bytes = Vec::new();
    for (i, turn) in turns.iter().enumerate() {
        bytes.extend_from_slice(&turn.line(None, None));
        bytes.push(b'\n');
        if i % 7 == 3 {
            bytes.extend_from_slice(b"{\"model_call_id\""); // a torn tail, completed next
            std::fs::write(&log, &bytes).unwrap();
            bytes.truncate(bytes.len() - 16);
            let outcome = resolve_file(&lineage, "r", &turn.next_request("n")).unwrap();
            assert_eq!(
                resolved(&outcome).1,
                turn.cumulative().as_slice(),
                "turn {i}"
            );
        }
    }
    std::fs::write(&log, &bytes).unwrap();
    for turn in &turns {
        let outcome = resolve_file(&lineage, "r", &turn.next_request("n")).unwrap();
        assert_eq!(resolved(&outcome).0, turn.call_id);
    }
}

/// Every line of `buf` as `fold` saw them before the one-pass scan: split at newlines, then
/// scanned.
fn split_then_scan(buf: &[u8]) -> Vec<(u64, usize, std::result::Result<LineMeta, String>)> {
    crate::log::complete_lines(buf, 0)
        .map(|(offset, line)| (offset, line.len(), scan_line(line)))
        .collect()
}

fn one_pass(buf: &[u8]) -> Vec<(u64, usize, std::result::Result<LineMeta, String>)> {
    let complete = &buf[..complete_prefix_len(buf)];
    let mut at = 0usize;
    let mut out = Vec::new();
    while at < complete.len() {
        let (len, meta) = scan_next_line(&complete[at..]);
        out.push((at as u64, len, meta));
        at += len + 1;
    }
    out
}

#[test]
fn the_one_pass_line_scan_agrees_with_split_then_scan() {
    let mut rng = Rng(0xd1b5_4a32_d192_ed03);
    let turns = conversation(6, "s");
    let mut base: Vec<u8> = Vec::new();
    for turn in &turns {
        base.extend_from_slice(&turn.line(Some("p"), None));
        base.push(b'\n');
    }
    // Blanks around the object, a string with escapes, nested values: all still one line.
    base.extend_from_slice(
        b" \t{\"model_call_id\":\"a\\\"b\\\\\",\"x\":[[1],{\"y\":\"\\n\"}],\"n\":-1.5e3} \r\n",
    );
    let bytes = b"\n\n\n\\\"\"[]{},:0 \r\tx";
    let mut lines_seen = 0usize;
    for case in 0..4000 {
        let mut buf = base.clone();
        for _ in 0..1 + rng.below(4) {
            let at = rng.below(buf.len());
            let byte = bytes[rng.below(bytes.len())];
            match rng.below(3) {
                0 => buf[at] = byte,
                1 => buf.insert(at, byte),
                _ => {
                    buf.remove(at);
                }
            }
        }
        if case % 5 == 0 {
            buf.truncate(rng.below(buf.len() + 1));
        }
        let expected = split_then_scan(&buf);
        lines_seen += expected.len();
        assert_eq!(
            one_pass(&buf),
            expected,
            "case {case}: {:?}",
            String::from_utf8_lossy(&buf)
        );
    }
    assert!(lines_seen > 4000 * 5);
    assert_eq!(one_pass(&base), split_then_scan(&base));
    assert!(split_then_scan(&base)
        .iter()
        .all(|(_, _, meta)| meta.is_ok()));
}

/// Integrity failures raise from a file as from memory, whichever way the winner's token
/// arrays arrive: taken from the bytes this resolve's look just read (mapped, or read into
/// the resolver's reused buffer, which a longer line of another rollout filled first, in one
/// window or in many), or read again from the file by a resolver that folded the line in an
/// earlier look. Sound lines answer their tokens all the same ways.
#[test]
fn file_integrity_failures_raise_from_the_bytes_a_look_read_and_from_the_file() {
    let turns = conversation(3, "i");
    let long = conversation(6, "long");
    let c0 = turns[0].cumulative();
    let cases: Vec<(&str, Vec<Vec<u8>>, usize)> = vec![
        ("sound", vec![turns[0].line(None, None)], 0),
        (
            "sound delta",
            vec![
                turns[0].line(None, None),
                turns[1].line(Some(&turns[0].call_id), Some(&c0)),
            ],
            1,
        ),
        (
            "digest",
            vec![corrupted(&turns[0], None, None, |v| {
                v["digest"] = json!(token_digest(&[1, 2, 3]))
            })],
            0,
        ),
        (
            "cum_len",
            vec![corrupted(&turns[0], None, None, |v| {
                v["cum_len"] = json!(3)
            })],
            0,
        ),
        (
            "token array",
            vec![corrupted(&turns[0], None, None, |v| {
                v["generation_token_ids"] = json!([1, -2])
            })],
            0,
        ),
        (
            "prompt changed",
            vec![corrupted(&turns[0], None, None, |v| {
                v["prompt_token_ids"][0] = json!(7)
            })],
            0,
        ),
        (
            "delta parent changed",
            vec![
                corrupted(&turns[0], None, None, |v| {
                    v["generation_token_ids"][0] = json!(7);
                    v["digest"] = json!("");
                }),
                turns[1].line(Some(&turns[0].call_id), Some(&c0)),
            ],
            1,
        ),
    ];
    for (name, lines, winner) in cases {
        for (map_at, window, earlier_look) in [
            (1, READ_WINDOW, false),
            (u64::MAX, READ_WINDOW, false),
            (u64::MAX, 97, false),
            (u64::MAX, READ_WINDOW, true),
            (1, READ_WINDOW, true),
        ] {
            let dir = tempfile::tempdir().unwrap();
            let mut log = Vec::new();
            for line in &lines {
                log.extend_from_slice(line);
                log.push(b'\n');
            }
            std::fs::write(dir.path().join("r.tokens.jsonl"), &log).unwrap();
            std::fs::write(dir.path().join("r.tokens.lock"), b"").unwrap();
            let mut other = Vec::new();
            for turn in &long {
                other.extend_from_slice(&turn.line(None, None));
                other.push(b'\n');
            }
            std::fs::write(dir.path().join("o.tokens.jsonl"), &other).unwrap();
            let lineage = FileLineage::new(dir.path(), 8, 1 << 20)
                .with_read_window(window)
                .with_map_at_least(map_at);
            let last = long.last().unwrap();
            let answer = resolve_file(&lineage, "o", &last.next_request("n")).unwrap();
            assert_eq!(resolved(&answer).1, last.cumulative().as_slice());
            if earlier_look {
                let unrelated = conversation(1, "none")[0].next_request("n");
                assert_eq!(
                    resolve_file(&lineage, "r", &unrelated).unwrap(),
                    unresolved(REASON_NO_MATCH)
                );
            }
            let result = resolve_file(&lineage, "r", &turns[winner].next_request("n"));
            let case = format!("{name} (map from {map_at}, window {window}, {earlier_look})");
            if name.starts_with("sound") {
                let outcome = result.unwrap_or_else(|e| panic!("{case}: {e}"));
                assert_eq!(
                    resolved(&outcome).1,
                    turns[winner].cumulative().as_slice(),
                    "{case}"
                );
            } else {
                assert!(
                    matches!(result, Err(LineageError::Integrity(_))),
                    "{case}: {result:?}"
                );
            }
        }
    }
}

// ---- the kept lock file descriptor --------------------------------------------------------

/// The file descriptors of this process open on `path` (by `/proc/self/fd`).
#[cfg(target_os = "linux")]
fn fds_on(path: &std::path::Path) -> usize {
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|fd| std::fs::read_link(fd.ok()?.path()).ok())
        .filter(|target| target == path)
        .count()
}

/// Run `work` on another thread while `held` is locked exclusively; it must still be waiting
/// after a while (it takes the rollout's lock), and finish once `held` is dropped.
fn waits_for<T: Send, H>(held: H, work: impl FnOnce() -> T + Send) -> T {
    use std::sync::atomic::AtomicBool;
    let done = AtomicBool::new(false);
    std::thread::scope(|scope| {
        let worker = scope.spawn(|| {
            let out = work();
            done.store(true, std::sync::atomic::Ordering::SeqCst);
            out
        });
        std::thread::sleep(std::time::Duration::from_millis(300));
        let early = done.load(std::sync::atomic::Ordering::SeqCst);
        drop(held);
        let out = worker.join().unwrap();
        assert!(
            !early,
            "the resolve went ahead while a writer held the rollout's lock"
        );
        out
    })
}

#[cfg(target_os = "linux")]
#[test]
fn a_resolver_keeps_the_lock_file_open_counted_and_evictable() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path(), 8).unwrap();
    let turns = conversation(2, "k");
    for rollout in ["a", "b", "c"] {
        store
            .put(rollout, &turns[0].call_id, &turns[0].line(None, None))
            .unwrap();
    }
    drop(store); // its own kept descriptors would muddle the counts below
    let lineage = FileLineage::new(dir.path(), 8, 1 << 20);
    let lock_a = dir.path().join("a.tokens.lock");
    assert_eq!(fds_on(&lock_a), 0);
    for rollout in ["a", "b", "c"] {
        let outcome = resolve_file(&lineage, rollout, &turns[0].next_request("n")).unwrap();
        assert_eq!(resolved(&outcome).0, turns[0].call_id);
    }
    // Each rollout keeps its log and its lock file: 3 x 2, all counted.
    assert_eq!(lineage.open_files(), 6);
    assert_eq!(fds_on(&lock_a), 1);
    // Resolving again reuses the kept descriptor instead of opening another.
    resolve_file(&lineage, "a", &turns[0].next_request("n")).unwrap();
    assert_eq!((fds_on(&lock_a), lineage.open_files()), (1, 6));
    // A cap of 3 descriptors keeps one rollout (2); the evicted ones' lock files are closed.
    let capped = FileLineage::with_max_open_files(dir.path(), 8, 1 << 20, Some(3));
    for rollout in ["a", "b", "c"] {
        resolve_file(&capped, rollout, &turns[0].next_request("n")).unwrap();
    }
    assert_eq!(capped.open_files(), 2);
    assert_eq!(
        fds_on(&lock_a),
        1,
        "only `lineage` still holds a's lock file"
    );
    assert_eq!(fds_on(&dir.path().join("c.tokens.lock")), 2);
    // Clearing closes them all.
    lineage.clear();
    capped.clear();
    assert_eq!((lineage.open_files(), capped.open_files()), (0, 0));
    assert_eq!(fds_on(&lock_a), 0);
}

#[test]
fn a_kept_lock_of_a_deleted_and_recreated_rollout_is_not_trusted() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path(), 8).unwrap();
    let lineage = FileLineage::new(dir.path(), 8, 1 << 20);
    let old = conversation(2, "old");
    for turn in &old {
        store
            .put("r", &turn.call_id, &turn.line(None, None))
            .unwrap();
    }
    let outcome = resolve_file(&lineage, "r", &old[1].next_request("n")).unwrap();
    assert_eq!(resolved(&outcome).0, old[1].call_id);
    // The resolver now keeps the old lock file open. Delete the rollout (which unlinks that
    // lock file) and write it anew: a new lock file, new entries.
    store.delete(&["r"]).unwrap();
    let new = conversation(2, "new");
    for turn in &new {
        store
            .put("r", &turn.call_id, &turn.line(None, None))
            .unwrap();
    }
    // A writer holds the new lock file: the resolve must wait for it (locking the unlinked
    // file it kept would exclude nobody), then answer from the new entries only.
    let lock_path = dir.path().join("r.tokens.lock");
    let held = RolloutLock::acquire(&lock_path, LockMode::Exclusive).unwrap();
    let next = new[1].next_request("n");
    let outcome = waits_for(held, || resolve_file(&lineage, "r", &next).unwrap());
    assert_eq!(resolved(&outcome).0, "new-call-001");
    assert_eq!(resolved(&outcome).1, new[1].cumulative().as_slice());
    assert_eq!(
        resolve_file(&lineage, "r", &old[1].next_request("n")).unwrap(),
        unresolved(REASON_NO_MATCH)
    );
}

#[test]
fn a_kept_lock_opened_by_another_process_is_never_locked() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path(), 8).unwrap();
    let lineage = FileLineage::new(dir.path(), 8, 1 << 20);
    let turns = conversation(2, "p");
    store
        .put("r", &turns[0].call_id, &turns[0].line(None, None))
        .unwrap();
    resolve_file(&lineage, "r", &turns[0].next_request("n")).unwrap();
    // A writer holds the lock; the resolver's kept descriptor is swapped for a duplicate of
    // the writer's, marked as opened by another process (as a forked child inherits one).
    // Locking through it would convert the writer's own lock and go ahead at once.
    let lock_path = dir.path().join("r.tokens.lock");
    let held = OpenOptions::new().read(true).open(&lock_path).unwrap();
    held.lock().unwrap();
    let id = FileId::of(&held.metadata().unwrap());
    {
        let rollout = lineage.rollouts.lock().peek("r").cloned().unwrap();
        let mut state = lock(&rollout);
        let kept = state.lock.as_mut().expect("a kept lock after a resolve");
        // The same open file description as the writer's lock (a `dup`).
        kept.file = lineage
            .rollouts
            .account()
            .keep(crate::lock::LockFile::new(held.try_clone().unwrap()));
        kept.id = id;
        kept.pid = crate::fork::current_pid().wrapping_add(1);
    }
    let outcome = waits_for(held, || {
        resolve_file(&lineage, "r", &turns[0].next_request("n")).unwrap()
    });
    assert_eq!(resolved(&outcome).0, turns[0].call_id);
}

/// A forked child holds a copy of the lock file descriptor the resolver keeps (the same open
/// file description). When a later resolve in the parent locks it and then fails (here: a
/// corrupt line past the cursor, under the shared lock), the lock must be released, not just
/// its descriptor closed: the child's copy would keep the shared lock for as long as the child
/// lives, and every put of the rollout, in every process, would wait for it.
#[test]
fn a_failed_resolve_releases_its_lock_though_a_forked_child_shares_the_descriptor() {
    use std::io::Write;
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path(), 8).unwrap();
    let lineage = FileLineage::new(dir.path(), 8, 1 << 20);
    let turns = conversation(2, "f");
    store
        .put("r", &turns[0].call_id, &turns[0].line(None, None))
        .unwrap();
    let next = turns[0].next_request("n");
    // The fork: the child's copy of the kept descriptor (resolved again if another test's
    // trim of the process budget closed the entry meanwhile).
    let childs_copy = (0..100)
        .find_map(|_| {
            resolve_file(&lineage, "r", &next).unwrap();
            let rollout = lineage.rollouts.lock().peek("r").cloned()?;
            let state = lock(&rollout);
            state.lock.as_ref()?.file.try_clone().ok()
        })
        .expect("a kept lock after a resolve");
    let log = dir.path().join("r.tokens.jsonl");
    let mut file = OpenOptions::new().append(true).open(&log).unwrap();
    file.write_all(b"not json\n").unwrap();
    assert!(matches!(
        resolve_file(&lineage, "r", &next),
        Err(LineageError::Store(Error::Corrupt { .. }))
    ));
    let lock_path = dir.path().join("r.tokens.lock");
    assert!(
        RolloutLock::try_acquire(&lock_path, LockMode::Exclusive)
            .unwrap()
            .is_some(),
        "the failed resolve left the rollout locked through the child's copy"
    );
    drop(childs_copy);
}

/// Six threads resolve every turn of four rollouts at random under a cap of 4 kept
/// descriptors (two rollouts' log and lock file): entries are evicted by one thread's settle
/// while another resolves through them (and a fresh entry is made beside the evicted one),
/// kept lock files are reused, verified and closed with their entries. Every answer is the
/// turn's tokens; at rest the cache is within its cap and what it counts is exactly what is
/// open on the rollouts' files (nothing leaked uncounted, nothing counted and closed).
#[cfg(target_os = "linux")]
#[test]
fn concurrent_resolves_under_a_small_descriptor_cap_answer_right_and_count_what_is_open() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path(), 8).unwrap();
    let turns = conversation(4, "e");
    let rollouts = ["a", "b", "c", "d"];
    for rollout in rollouts {
        for (i, turn) in turns.iter().enumerate() {
            let parent = i.checked_sub(1).map(|p| turns[p].call_id.as_str());
            store
                .put(rollout, &turn.call_id, &turn.line(parent, None))
                .unwrap();
        }
    }
    store.clear(); // the store's own kept descriptors would muddle the counts below
    let lineage = FileLineage::with_max_open_files(dir.path(), 8, 1 << 20, Some(4));
    std::thread::scope(|scope| {
        for thread in 0..6u64 {
            let (lineage, turns) = (&lineage, &turns);
            scope.spawn(move || {
                let mut rng = crate::json::tests::Lcg(thread);
                for _ in 0..40 {
                    let rollout = rollouts[rng.next(4) as usize];
                    let turn = &turns[rng.next(4) as usize];
                    let outcome = resolve_file(lineage, rollout, &turn.next_request("n")).unwrap();
                    assert_eq!(resolved(&outcome).0, turn.call_id);
                    assert_eq!(resolved(&outcome).1, turn.cumulative().as_slice());
                }
            });
        }
    });
    // Another test's trim of the process budget may close an entry meanwhile: compare a
    // count of the open descriptors taken while the cache's own count stood still.
    let counted_and_open = (0..100).find_map(|_| {
        let before = lineage.open_files();
        let open: usize = rollouts
            .iter()
            .flat_map(|r| [format!("{r}.tokens.lock"), format!("{r}.tokens.jsonl")])
            .map(|name| fds_on(&dir.path().join(name)))
            .sum();
        (lineage.open_files() == before).then_some((before, open))
    });
    let (counted, open) = counted_and_open.expect("a stable count");
    assert!(counted <= 4, "{counted}");
    assert_eq!(open, counted);
    lineage.clear();
    let open: usize = rollouts
        .iter()
        .map(|r| fds_on(&dir.path().join(format!("{r}.tokens.lock"))))
        .sum();
    assert_eq!((open, lineage.open_files()), (0, 0));
}

#[test]
fn an_unverified_answer_names_its_digest_and_is_cached_only_once_verified() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path(), 8).unwrap();
    let lineage = FileLineage::new(dir.path(), 8, 1 << 20);
    let turns = conversation(2, "u");
    store
        .put("r", &turns[0].call_id, &turns[0].line(None, None))
        .unwrap();
    // The first answer has no cached parent: verified as it is built, nothing deferred.
    let mut request = ItemsRequest::new(turns[0].next_request("n"));
    let Step::Done(Outcome::Resolved { unverified, .. }) =
        lineage.resolve_unverified("r", &mut request).unwrap()
    else {
        panic!("expected resolved");
    };
    assert_eq!(unverified.0, None);
    let cached = lineage.cached_tokens();
    assert_eq!(cached, 8); // turn 0: 5 prompt + 3 generated ids
    store
        .put(
            "r",
            &turns[1].call_id,
            &turns[1].line(Some(&turns[0].call_id), None),
        )
        .unwrap();
    let mut request = ItemsRequest::new(turns[1].next_request("n"));
    let Step::Done(Outcome::Resolved {
        tokens, unverified, ..
    }) = lineage.resolve_unverified("r", &mut request).unwrap()
    else {
        panic!("expected resolved");
    };
    let expected = turns[1].cumulative();
    assert_eq!(*tokens, expected);
    assert_eq!(
        unverified.0.as_deref(),
        Some(token_digest(&expected).as_str())
    );
    // Not cached before its check; a wrong digest fails it and caches nothing.
    assert_eq!(lineage.cached_tokens(), cached);
    assert!(!lineage.verify(&tokens, &token_digest(&[1, 2, 3])));
    assert_eq!(lineage.cached_tokens(), cached);
    assert!(lineage.verify(&tokens, &token_digest(&expected)));
    assert_eq!(lineage.cached_tokens(), cached + 16);
    // `resolve` never defers.
    let mut request = ItemsRequest::new(turns[1].next_request("n"));
    let Step::Done(Outcome::Resolved { unverified, .. }) =
        lineage.resolve("r", &mut request).unwrap()
    else {
        panic!("expected resolved");
    };
    assert_eq!(unverified.0, None);
}

#[test]
fn a_request_fingerprinted_before_it_is_resolved_is_not_hashed_again() {
    // The bindings fingerprint a request when `resolve` is called (refusing bad content
    // then) and resolve it later: the fingerprint is computed once, and the answer is the
    // one a fresh request gets.
    let lineage = MemoryLineage::new(8, 1 << 20, 1 << 20);
    let turns = conversation(2, "m");
    lineage
        .put("r", &turns[0].line(None, None))
        .expect("put turn 0");
    let items = turns[0].next_request("n");
    let mut request = ItemsRequest::new(items.clone());
    let fingerprint = request.fingerprint().unwrap();
    assert_eq!(
        fingerprint,
        fingerprint::assistant_fingerprint(&items).unwrap()
    );
    let fresh = resolve_mem(&lineage, "r", &items);
    let Step::Done(prepared) = lineage.resolve("r", &mut request).unwrap() else {
        panic!("expected an answer");
    };
    assert_eq!(resolved(&prepared), resolved(&fresh));
    // White box: the memo answers, the items' authored turns are not read again.
    request.items[1] = assistant("another reply");
    assert_eq!(request.fingerprint().unwrap(), fingerprint);
}
