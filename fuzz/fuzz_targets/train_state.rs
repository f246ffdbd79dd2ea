#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| eesd_train::fuzz::train_state(data));
