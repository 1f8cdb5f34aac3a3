//! `CNI_ARGS` as the runtime passes it (`K=V;K=V`).

#![no_main]

use capture_model::cni::{parse_cni_args, K8sArgs};
use libfuzzer_sys::fuzz_target;

fn render(a: &K8sArgs) -> String {
    let mut s = format!(
        "K8S_POD_NAMESPACE={};K8S_POD_NAME={};K8S_POD_UID={}",
        a.namespace, a.name, a.uid
    );
    if !a.infra_container_id.is_empty() {
        s.push_str(";K8S_POD_INFRA_CONTAINER_ID=");
        s.push_str(&a.infra_container_id);
    }
    s
}

fuzz_target!(|data: &[u8]| {
    // Environment variables reach rscni as Rust strings: anything else fails before parsing.
    let Ok(raw) = std::str::from_utf8(data) else {
        return;
    };
    match parse_cni_args(Some(raw)) {
        Ok(a) => {
            for (what, v) in [
                ("namespace", &a.namespace),
                ("name", &a.name),
                ("uid", &a.uid),
            ] {
                assert!(!v.is_empty(), "empty {what} accepted from {raw:?}");
            }
            for v in [&a.namespace, &a.name, &a.uid, &a.infra_container_id] {
                assert!(!v.contains(';'), "{v:?} holds the separator");
                assert!(raw.contains(v.as_str()), "{v:?} is not in {raw:?}");
            }
            let again = parse_cni_args(Some(&render(&a)));
            assert_eq!(again.as_ref(), Ok(&a), "CNI_ARGS do not read back");
        }
        Err(e) => assert!(
            e.contains(&format!("{raw:?}")),
            "the error does not show the input: {e}"
        ),
    }
});
