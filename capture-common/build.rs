//! `CAPTURE_LAYOUT_VARIANT=next` builds the next map layouts (`cfg(capture_layout_next)`): a
//! second build of the same sources whose pod-config and counter maps differ from this one's, so
//! that the upgrade tests can take a node from one layout to the other and back.

fn main() {
    println!("cargo:rustc-check-cfg=cfg(capture_layout_next)");
    println!("cargo:rerun-if-env-changed=CAPTURE_LAYOUT_VARIANT");
    match std::env::var("CAPTURE_LAYOUT_VARIANT").as_deref() {
        Ok("next") => println!("cargo:rustc-cfg=capture_layout_next"),
        Ok("") | Err(_) => {}
        Ok(other) => panic!("CAPTURE_LAYOUT_VARIANT={other}: the only variant is `next`"),
    }
}
