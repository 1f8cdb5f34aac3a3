//! Pod records as they are read back from the state directory (the agent at start, status,
//! detach, GC, the CNI plugin's DEL while the agent is down).

#![no_main]

use capture_model::record;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(rec) = record::decode(data) else {
        return;
    };
    let written = record::encode(&rec);
    let back = record::decode(&written).unwrap_or_else(|e| {
        panic!(
            "a record as written does not read back ({e}): {}",
            String::from_utf8_lossy(&written)
        )
    });
    assert_eq!(back, rec, "a record changed through the disk");
    let _ = rec.config.ebpf_unsupported();
});
