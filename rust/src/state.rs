//! The state index `R.tokens.state.json`.
//!
//! It records the lifecycle flags (`frozen`, `retired` — the fence — and `incomplete`), the
//! snapshot id and version, and `entry_digests` for the first `indexed_size` bytes of the log.
//! It is only a cache of the log for entries: bytes past `indexed_size` are an acknowledged
//! tail that every reader folds in the same way, so a state that lags the log is normal, and so
//! is none at all: a missing state file is a fresh rollout, and no put writes one before the
//! rollout's first checkpoint (`store`).
//!
//! Every write is an atomic replace (temporary file, fsync, rename). Lifecycle transitions
//! also fsync the directory before they return. A state file that cannot be parsed was never
//! written by us and is refused with its path, never silently reset (a reset would drop a
//! fence or an incomplete flag).

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::{self, Read, Write};
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{Error, IoContext, Result};

/// The state index. Fields are declared in sorted order so the compact serde output has sorted
/// keys and no spaces, byte for byte what the reference writes with orjson `OPT_SORT_KEYS`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct State {
    pub entry_digests: BTreeMap<String, String>,
    pub frozen: bool,
    pub incomplete: bool,
    pub indexed_size: u64,
    pub retired: bool,
    pub snapshot_id: String,
    pub version: u64,
}

impl State {
    /// The state a retired rollout keeps: flags, snapshot and version stay, entries go.
    pub fn fenced(&self) -> State {
        State {
            entry_digests: BTreeMap::new(),
            indexed_size: 0,
            retired: true,
            ..self.clone()
        }
    }

    pub fn to_json(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("state serializes")
    }

    pub fn parse(bytes: &[u8], path: &Path) -> Result<State> {
        if bytes.is_empty() {
            return Err(Error::corrupt(path, 0, "state index is empty (truncated)"));
        }
        if bytes.trim_ascii_start().first() != Some(&b'{') {
            return Err(Error::corrupt(path, 0, "state index is not a JSON object"));
        }
        let state: State = serde_json::from_slice(bytes).map_err(|err| {
            Error::corrupt(path, 0, format!("state index is not valid JSON: {err}"))
        })?;
        if let Some((call_id, digest)) = state
            .entry_digests
            .iter()
            .find(|(_, digest)| !is_hex_digest(digest))
        {
            return Err(Error::corrupt(
                path,
                0,
                format!("state index digest for {call_id:?} is not 64 hex digits: {digest:?}"),
            ));
        }
        Ok(state)
    }
}

pub(crate) fn is_hex_digest(text: &str) -> bool {
    text.len() == 64 && text.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// Read the state file through an open handle (keeping the handle pins its inode).
pub fn read_from(file: &mut File, path: &Path) -> Result<State> {
    let mut bytes = Vec::new();
    file.read_to_end(&mut bytes).ctx("read state", path)?;
    State::parse(&bytes, path)
}

/// Open and read `path`; `Ok(None)` when it does not exist.
pub fn open_and_read(path: &Path) -> Result<Option<(File, State)>> {
    match crate::descriptors::retry(|| File::open(path)) {
        Ok(mut file) => {
            let state = read_from(&mut file, path)?;
            Ok(Some((file, state)))
        }
        Err(err) if err.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(err) => Err(err).ctx("open state", path),
    }
}

/// Atomically replace `path` with `state`: write `tmp`, fsync it, rename over `path`.
/// Returns the handle of the new file (its inode is what `path` now names). The caller fsyncs
/// the directory when the rename itself must be durable before returning.
pub fn write_atomic(path: &Path, tmp: &Path, state: &State) -> Result<File> {
    let mut options = OpenOptions::new();
    options.write(true).read(true).create(true).truncate(true);
    let mut file = crate::descriptors::retry(|| options.open(tmp)).ctx("create state temp", tmp)?;
    let written = file
        .write_all(&state.to_json())
        .and_then(|()| file.sync_data());
    if let Err(err) = written {
        let _ = std::fs::remove_file(tmp);
        return Err(err).ctx("write state temp", tmp);
    }
    std::fs::rename(tmp, path).ctx("replace state", path)?;
    Ok(file)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serializes_like_the_reference() {
        // shared/golden/store-0.7.0/golden-dropped.tokens.state.json, byte for byte.
        let golden = br#"{"entry_digests":{},"frozen":true,"incomplete":false,"indexed_size":0,"retired":true,"snapshot_id":"573e5f9f80bf4aabb12db15fca1f72ec","version":2}"#;
        let state = State::parse(golden, Path::new("x")).unwrap();
        assert!(state.retired && state.frozen && state.version == 2);
        assert_eq!(state.to_json(), golden.to_vec());
    }

    #[test]
    fn refuses_truncated_or_foreign_state() {
        for bad in [&b""[..], b"{\"frozen\":", b"not json", b"[]"] {
            let err = State::parse(bad, Path::new("r.tokens.state.json")).unwrap_err();
            assert!(matches!(err, Error::Corrupt { .. }), "{err}");
            assert!(err.to_string().contains("r.tokens.state.json"));
        }
        let wrong_digest = br#"{"entry_digests":{"c":"xyz"}}"#;
        assert!(State::parse(wrong_digest, Path::new("s")).is_err());
    }

    #[test]
    fn atomic_write_replaces_and_leaves_no_temp() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("r.tokens.state.json");
        let tmp = dir.path().join("r.tokens.state.json.tmp");
        let state = State {
            version: 3,
            ..State::default()
        };
        write_atomic(&path, &tmp, &state).unwrap();
        assert!(!tmp.exists());
        let (_, read) = open_and_read(&path).unwrap().unwrap();
        assert_eq!(read, state);
        assert!(open_and_read(&dir.path().join("absent")).unwrap().is_none());
    }
}
