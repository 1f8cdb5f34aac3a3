//! Every annotation capture reads, and the node's mesh settings (owner groups, the loopback
//! CIDR, DNS), through the validation the agent and the CLI run on each pod.

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // Kubernetes annotations are UTF-8 strings.
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let mut spec = capture_fuzz::pod_spec(text);
    let _ = capture_fuzz::validate(&mut spec);
});
