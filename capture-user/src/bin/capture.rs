//! `capture`: attach, detach and inspect eBPF traffic capture for mesh pods.

use clap::Parser as _;

fn main() -> std::process::ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    match capture_user::cli::run(capture_user::cli::Cli::parse()) {
        Ok(capture_user::cli::Outcome::Success) => std::process::ExitCode::SUCCESS,
        Ok(capture_user::cli::Outcome::NotCaptured(reason)) => {
            eprintln!("capture: validate: {reason}");
            std::process::ExitCode::from(capture_user::validate::NOT_CAPTURED_EXIT)
        }
        Err(e) => {
            // Library errors already carry their causes in their messages: print the top one only.
            eprintln!("capture: error: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
