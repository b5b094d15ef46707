//! The tail scan on arbitrary bytes (see `properties::tail_scan_is_exact`).
#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "../properties.rs"]
mod properties;

fuzz_target!(|input: (u32, &[u8])| properties::tail_scan_is_exact(u64::from(input.0), input.1));
