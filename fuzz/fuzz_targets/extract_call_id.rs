//! `extract_call_id` on arbitrary bytes (see `properties::call_id_agrees_with_a_parser`).
#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "../properties.rs"]
mod properties;

fuzz_target!(|data: &[u8]| properties::call_id_agrees_with_a_parser(data));
