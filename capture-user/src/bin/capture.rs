//! `capture`: attach, detach and inspect eBPF traffic capture for mesh pods.

use clap::Parser as _;

fn main() -> std::process::ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    match capture_user::cli::run(capture_user::cli::Cli::parse()) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            // Library errors already carry their causes in their messages: print the top one only.
            eprintln!("capture: error: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
