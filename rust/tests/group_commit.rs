//! Group commit of one rollout's puts (`Store::queue_put` / `Store::write_puts`): the puts
//! queued behind a rollout's writer are committed together, each with the outcome it would
//! have had alone, one after another, and each answered only after its line is durable.

use std::fs;
use std::path::Path;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};

use tokencapture::store::{OnConflict, PutBatch, PutDone};
use tokencapture::{Error, PutOutcome, Result, Store};

fn line(call: &str, tokens: &str) -> Vec<u8> {
    format!(r#"{{"model_call_id":"{call}","prompt_token_ids":[{tokens}],"rollout_id":"r"}}"#)
        .into_bytes()
}

type Outcomes = Arc<Mutex<Vec<(String, Result<PutOutcome>)>>>;

/// A `done` that records (label, outcome) in call order.
fn recorder(outcomes: &Outcomes, label: &str) -> PutDone {
    let outcomes = Arc::clone(outcomes);
    let label = label.to_owned();
    Box::new(move |outcome| outcomes.lock().unwrap().push((label, outcome)))
}

fn log_of(dir: &Path, rollout: &str) -> Vec<u8> {
    fs::read(dir.join(format!("{rollout}.tokens.jsonl"))).unwrap_or_default()
}

fn lines(parts: &[Vec<u8>]) -> Vec<u8> {
    parts
        .iter()
        .flat_map(|l| [l.clone(), b"\n".to_vec()].concat())
        .collect()
}

/// The first put makes the caller the writer; nothing is written until it writes.
fn first(store: &Store, outcomes: &Outcomes, call: &str, body: &[u8]) -> PutBatch {
    store
        .queue_put("r", call, body.to_vec(), recorder(outcomes, call))
        .expect("the first put of a rollout becomes its writer")
}

fn queue(store: &Store, outcomes: &Outcomes, label: &str, call: &str, body: &[u8]) {
    let writer = store.queue_put("r", call, body.to_vec(), recorder(outcomes, label));
    assert!(
        writer.is_none(),
        "a put behind a writer is queued, not a second writer"
    );
}

#[test]
fn queued_puts_are_committed_by_the_writer_in_arrival_order() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path(), 16).unwrap();
    let outcomes = Outcomes::default();
    let batch = first(&store, &outcomes, "a", &line("a", "1"));
    for call in ["b", "c", "d"] {
        queue(&store, &outcomes, call, call, &line(call, "2"));
    }
    // Queued, not yet durable, not yet answered.
    assert!(outcomes.lock().unwrap().is_empty());
    assert!(log_of(dir.path(), "r").is_empty());
    store.write_puts("r", batch);
    let got: Vec<_> = outcomes
        .lock()
        .unwrap()
        .iter()
        .map(|(label, outcome)| (label.clone(), *outcome.as_ref().unwrap()))
        .collect();
    let appended = |l: &str| (l.to_owned(), PutOutcome::Appended);
    assert_eq!(got, ["a", "b", "c", "d"].map(appended));
    assert_eq!(
        log_of(dir.path(), "r"),
        lines(&[
            line("a", "1"),
            line("b", "2"),
            line("c", "2"),
            line("d", "2")
        ])
    );
    // The writer left: the next put is a new writer.
    let again = Outcomes::default();
    let batch = first(&store, &again, "e", &line("e", "3"));
    store.write_puts("r", batch);
    assert_eq!(store.freeze("r").unwrap().records.lines.len(), 5);
}

#[test]
fn a_batch_decides_each_put_as_if_it_ran_alone_in_order() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path(), 16).unwrap();
    let outcomes = Outcomes::default();
    // The writer's first batch is its own put; everything queued behind it is the second.
    let batch = first(&store, &outcomes, "w", &line("w", "0"));
    queue(&store, &outcomes, "a", "a", &line("a", "1"));
    queue(&store, &outcomes, "a again", "a", &line("a", "1")); // same call, same bytes
    queue(&store, &outcomes, "b", "b", &line("b", "2"));
    queue(&store, &outcomes, "a changed", "a", &line("a", "9")); // same call, other bytes
    queue(&store, &outcomes, "c", "c", &line("c", "3"));
    queue(&store, &outcomes, "bad", "", &line("x", "4")); // refused when queued
    store.write_puts("r", batch);
    let got = outcomes.lock().unwrap();
    let summary: Vec<String> = got
        .iter()
        .map(|(label, outcome)| match outcome {
            Ok(outcome) => format!("{label}: {outcome:?}"),
            Err(Error::Conflict { call_id, .. }) => format!("{label}: conflict {call_id}"),
            Err(Error::InvalidInput(_)) => format!("{label}: invalid"),
            Err(other) => format!("{label}: {other}"),
        })
        .collect();
    assert_eq!(
        summary,
        [
            "bad: invalid", // answered at once, before the writer ran
            "w: Appended",
            "a: Appended",
            "a again: Duplicate",
            "b: Appended",
            "a changed: conflict a",
            "c: Appended",
        ]
    );
    // The lines before the conflict were made durable before it was recorded; the rollout
    // is incomplete, and the put after the conflict still stored its line.
    assert_eq!(
        log_of(dir.path(), "r"),
        lines(&[
            line("w", "0"),
            line("a", "1"),
            line("b", "2"),
            line("c", "3")
        ])
    );
    let snapshot = store.freeze("r").unwrap();
    assert!(snapshot.incomplete);
}

#[test]
fn every_put_of_a_failing_batch_gets_the_error() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path(), 16).unwrap();
    store.put("r", "a", &line("a", "1")).unwrap();
    store.freeze("r").unwrap();
    let outcomes = Outcomes::default();
    let batch = first(&store, &outcomes, "b", &line("b", "2"));
    queue(&store, &outcomes, "c", "c", &line("c", "3"));
    store.write_puts("r", batch);
    let got = outcomes.lock().unwrap();
    assert_eq!(got.len(), 2);
    for (label, outcome) in got.iter() {
        assert!(
            matches!(outcome, Err(Error::Frozen(_))),
            "{label}: {outcome:?}"
        );
    }
}

#[test]
fn puts_from_many_threads_are_all_answered_and_stored_once() {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(Store::open(dir.path(), 16).unwrap());
    let (sender, receiver) = mpsc::channel();
    let threads: Vec<_> = (0..16)
        .map(|t| {
            let store = Arc::clone(&store);
            let sender = sender.clone();
            std::thread::spawn(move || {
                for i in 0..20 {
                    let call = format!("t{t}-{i}");
                    let sender = sender.clone();
                    let done: PutDone = Box::new(move |outcome| sender.send(outcome).unwrap());
                    let rollout = format!("r{}", i % 2);
                    store.put_then(&rollout, &call, line(&call, "1"), OnConflict::Mark, done);
                }
            })
        })
        .collect();
    for thread in threads {
        thread.join().unwrap();
    }
    drop(sender);
    let outcomes: Vec<_> = receiver.iter().collect();
    assert_eq!(outcomes.len(), 16 * 20);
    assert!(outcomes
        .iter()
        .all(|o| matches!(o, Ok(PutOutcome::Appended))));
    let stored = store.freeze("r0").unwrap().records.lines.len()
        + store.freeze("r1").unwrap().records.lines.len();
    assert_eq!(stored, 16 * 20);
}
