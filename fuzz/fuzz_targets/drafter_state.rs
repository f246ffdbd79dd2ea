#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| eesd_models::fuzz::drafter_state(data));
