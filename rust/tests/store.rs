//! The store core exercised directly, without Python: recovery, truncation, fences, locks.

use std::fs;
use std::io::Write;
use std::path::Path;

use tokencapture::digest::payload_digest;
use tokencapture::state::State;
use tokencapture::{Error, PutOutcome, Store};

fn line(call: &str, tokens: &str) -> Vec<u8> {
    format!(r#"{{"model_call_id":"{call}","prompt_token_ids":[{tokens}],"rollout_id":"r"}}"#)
        .into_bytes()
}

fn store(dir: &Path) -> Store {
    Store::open(dir, 16).unwrap()
}

fn state(dir: &Path, rollout: &str) -> State {
    let bytes = fs::read(dir.join(format!("{rollout}.tokens.state.json"))).unwrap();
    State::parse(&bytes, Path::new("state")).unwrap()
}

fn call_ids(store: &Store, rollout: &str) -> Vec<String> {
    let snapshot = store.freeze(rollout).unwrap();
    snapshot
        .records
        .lines
        .iter()
        .map(|range| {
            tokencapture::json::extract_call_id(&snapshot.records.buf[range.clone()], None).unwrap()
        })
        .collect()
}

#[test]
fn put_is_idempotent_and_conflicts_mark_incomplete() {
    let dir = tempfile::tempdir().unwrap();
    let store = store(dir.path());
    assert_eq!(
        store.put("r", "a", &line("a", "1,2")).unwrap(),
        PutOutcome::Appended
    );
    assert_eq!(
        store.put("r", "a", &line("a", "1,2")).unwrap(),
        PutOutcome::Duplicate
    );
    let err = store.put("r", "a", &line("a", "1,3")).unwrap_err();
    assert!(matches!(err, Error::Conflict { .. }), "{err}");
    let persisted = state(dir.path(), "r");
    assert!(persisted.incomplete);
    assert_eq!(persisted.version, 2);
    let log = fs::read(dir.path().join("r.tokens.jsonl")).unwrap();
    assert_eq!(log, [line("a", "1,2"), b"\n".to_vec()].concat());
}

#[test]
fn a_tail_written_by_another_writer_is_folded_with_version_bumps() {
    let dir = tempfile::tempdir().unwrap();
    let first = store(dir.path());
    first.put("r", "a", &line("a", "1")).unwrap();
    let second = store(dir.path());
    second.put("r", "b", &line("b", "2")).unwrap();
    let mut log = fs::OpenOptions::new()
        .append(true)
        .open(dir.path().join("r.tokens.jsonl"))
        .unwrap();
    log.write_all(&[line("c", "3"), b"\n".to_vec()].concat())
        .unwrap();
    // The first store's cached index is stale; the put folds b and c in before appending d.
    first.put("r", "d", &line("d", "4")).unwrap();
    let snapshot = first.freeze("r").unwrap();
    assert_eq!(snapshot.version, 5);
    assert_eq!(call_ids(&store(dir.path()), "r"), ["a", "b", "c", "d"]);
    let digests = state(dir.path(), "r").entry_digests;
    assert_eq!(digests["c"], payload_digest(&line("c", "3")));
}

#[test]
fn a_torn_line_is_truncated_by_the_next_writer() {
    let dir = tempfile::tempdir().unwrap();
    let store = store(dir.path());
    store.put("r", "a", &line("a", "1")).unwrap();
    let path = dir.path().join("r.tokens.jsonl");
    let good = fs::read(&path).unwrap();
    fs::OpenOptions::new()
        .append(true)
        .open(&path)
        .unwrap()
        .write_all(&line("b", "2"))
        .unwrap(); // complete JSON, but no newline: never acknowledged
    assert_eq!(store.read_records("r").unwrap().lines.len(), 1);
    assert_eq!(
        fs::read(&path).unwrap().len(),
        good.len() + line("b", "2").len()
    );
    store.put("r", "c", &line("c", "3")).unwrap();
    assert_eq!(
        fs::read(&path).unwrap(),
        [good, line("c", "3"), b"\n".to_vec()].concat()
    );
}

#[test]
fn a_corrupt_complete_line_raises_with_file_and_offset() {
    let dir = tempfile::tempdir().unwrap();
    let store = store(dir.path());
    store.put("r", "a", &line("a", "1")).unwrap();
    let path = dir.path().join("r.tokens.jsonl");
    let offset = fs::metadata(&path).unwrap().len();
    fs::OpenOptions::new()
        .append(true)
        .open(&path)
        .unwrap()
        .write_all(b"{\"model_call_id\":\"b\",\"x\":[1,\n")
        .unwrap();
    match store.freeze("r").unwrap_err() {
        Error::Corrupt {
            path: bad,
            offset: at,
            ..
        } => {
            assert_eq!(bad, path);
            assert_eq!(at, offset);
        }
        other => panic!("expected corruption, got {other}"),
    }
}

#[test]
fn freeze_fences_and_drop_needs_the_exact_snapshot() {
    let dir = tempfile::tempdir().unwrap();
    let store = store(dir.path());
    store.put("r", "a", &line("a", "1")).unwrap();
    let snapshot = store.freeze("r").unwrap();
    assert!(matches!(
        store.put("r", "b", &line("b", "2")),
        Err(Error::Frozen(_))
    ));
    assert!(matches!(store.begin_call("r", "b"), Err(Error::Frozen(_))));
    store.mark_incomplete("r", b"b").unwrap();
    assert!(!store
        .drop_snapshot("r", &snapshot.snapshot_id, snapshot.version)
        .unwrap());
    let again = store.freeze("r").unwrap();
    assert_eq!(again.snapshot_id, snapshot.snapshot_id);
    assert_eq!(again.version, snapshot.version + 1);
    assert!(again.incomplete);
    assert!(store
        .drop_snapshot("r", &again.snapshot_id, again.version)
        .unwrap());
    assert!(!dir.path().join("r.tokens.jsonl").exists());
    assert!(state(dir.path(), "r").retired);
    assert!(matches!(
        store.put("r", "c", &line("c", "3")),
        Err(Error::Retired(_))
    ));
    assert!(matches!(
        store.mark_incomplete("r", b""),
        Err(Error::Retired(_))
    ));
}

#[test]
fn retire_fences_every_id_and_delete_leaves_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let store = store(dir.path());
    store.put("a", "x", &line("x", "1")).unwrap();
    let removal = store.retire(&["a", "never", "a"]).unwrap();
    assert_eq!(removal.removed, ["a"]);
    assert_eq!(removal.absent, ["never"]);
    assert!(state(dir.path(), "never").retired);
    let removal = store.delete(&["a", "never"]).unwrap();
    assert_eq!(removal.removed, ["a", "never"]);
    assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 0);
    assert_eq!(
        store.put("a", "x", &line("x", "9")).unwrap(),
        PutOutcome::Appended
    );
}

#[test]
fn invalid_input_is_refused_before_any_file_exists() {
    let dir = tempfile::tempdir().unwrap();
    let store = store(dir.path());
    for bad in ["", "../x", "a b", &"x".repeat(201)] {
        assert!(matches!(
            store.put(bad, "c", &line("c", "1")),
            Err(Error::InvalidInput(_))
        ));
    }
    assert!(matches!(
        store.put("r", "a\nb", &line("c", "1")),
        Err(Error::InvalidInput(_))
    ));
    assert!(matches!(
        store.put("r", "c", b"{\n}"),
        Err(Error::InvalidInput(_))
    ));
    assert!(matches!(
        store.retire(&["ok", "no/pe"]),
        Err(Error::InvalidInput(_))
    ));
    assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 0);
}

#[test]
fn writers_in_threads_lose_and_duplicate_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let store = std::sync::Arc::new(store(dir.path()));
    let workers: Vec<_> = (0..8)
        .map(|worker| {
            let store = std::sync::Arc::clone(&store);
            std::thread::spawn(move || {
                for n in 0..25 {
                    let call = format!("w{worker}-{n}");
                    store.put("shared", &call, &line(&call, "1")).unwrap();
                    store.put("shared", &call, &line(&call, "1")).unwrap();
                }
            })
        })
        .collect();
    for worker in workers {
        worker.join().unwrap();
    }
    let snapshot = store.freeze("shared").unwrap();
    assert_eq!(snapshot.records.lines.len(), 200);
    assert_eq!(snapshot.version, 201);
}

#[test]
#[cfg(target_os = "linux")]
fn appends_reserve_blocks_past_the_end_and_the_first_freeze_gives_them_back() {
    use std::os::unix::fs::MetadataExt;
    let dir = tempfile::tempdir().unwrap();
    let store = store(dir.path());
    let log = dir.path().join("r.tokens.jsonl");
    let mut expected = Vec::new();
    for n in 0..5 {
        let call = format!("c{n}");
        let record = line(&call, "1,2,3");
        store.put("r", &call, &record).unwrap();
        expected.extend_from_slice(&record);
        expected.push(b'\n');
    }
    // Readers see exactly the records: the reservation does not change the size.
    assert_eq!(fs::read(&log).unwrap(), expected);
    let allocated = |path: &Path| fs::metadata(path).unwrap().blocks() * 512;
    assert!(
        allocated(&log) >= 64 << 10,
        "no blocks reserved past the end: {} bytes allocated",
        allocated(&log)
    );
    store.freeze("r").unwrap();
    assert_eq!(fs::read(&log).unwrap(), expected);
    assert!(
        allocated(&log) <= 8 << 10,
        "the freeze kept the reservation: {} bytes allocated",
        allocated(&log)
    );
}

#[test]
fn a_recycled_read_buffer_never_shows_an_earlier_log() {
    let dir = tempfile::tempdir().unwrap();
    let store = store(dir.path());
    let long: Vec<String> = (0..2000).map(|n| n.to_string()).collect();
    store.put("big", "b", &line("b", &long.join(","))).unwrap();
    store.put("small", "s", &line("s", "7")).unwrap();
    let big = store.freeze("big").unwrap();
    let big_len = big.records.buf.len();
    store.recycle_buffer(big.records.buf);
    // The small log is read into the big one's memory: only its own bytes may show.
    let small = store.freeze("small").unwrap();
    assert!(
        small.records.buf.capacity() >= big_len,
        "the buffer was not reused"
    );
    assert_eq!(
        small.records.buf,
        fs::read(dir.path().join("small.tokens.jsonl")).unwrap()
    );
    assert_eq!(call_ids(&store, "small"), ["s"]);
}
