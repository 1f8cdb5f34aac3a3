//! `capture-cni`: the chained CNI plugin that asks the capture agent to capture each new pod.

use rscni_plugin::cni::Plugin;

fn main() -> std::process::ExitCode {
    let capture = capture_cni::plugin::CapturePlugin::starting();
    let plugin = Plugin::default().msg(concat!("capture-cni ", env!("CARGO_PKG_VERSION")));
    match plugin.run(&capture) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        // rscni has already written the CNI error JSON to stdout.
        Err(_) => std::process::ExitCode::FAILURE,
    }
}
