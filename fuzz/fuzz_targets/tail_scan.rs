//! The tail scan a reader runs over the bytes past the state index: `complete_lines` plus
//! `extract_call_id` on every line. On arbitrary bytes it must never panic, must yield
//! exactly the newline-terminated lines (in order, at their offsets, without newlines) and
//! must leave out the torn tail after the last newline, and a walk carrying `Repeats` across the
//! lines must judge every line as a walk of that line alone does.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tokencapture::json::{extract_call_id, Repeats};
use tokencapture::log::{complete_lines, complete_prefix_len};

fuzz_target!(|input: (u32, &[u8])| {
    let (base, buf) = input;
    let base = u64::from(base);
    let prefix = complete_prefix_len(buf);
    assert!(prefix <= buf.len());
    assert!(prefix == 0 || buf[prefix - 1] == b'\n');
    assert!(
        !buf[prefix..].contains(&b'\n'),
        "a newline was left in the torn tail"
    );
    let mut rebuilt = Vec::with_capacity(prefix);
    let mut repeats = Repeats::new();
    for (offset, line) in complete_lines(buf, base) {
        assert_eq!(offset, base + rebuilt.len() as u64);
        assert!(!line.contains(&b'\n'));
        rebuilt.extend_from_slice(line);
        rebuilt.push(b'\n');
        // Either a record or an error the store turns into corruption; never a panic. Reusing
        // arrays of earlier lines (as the store's scan does) never changes the answer.
        let alone = extract_call_id(line, None);
        assert_eq!(extract_call_id(line, Some(&mut repeats)), alone);
    }
    assert_eq!(&rebuilt[..], &buf[..prefix]);
});
