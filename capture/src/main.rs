//! `capture`: attach, detach and inspect eBPF traffic capture for mesh pods.

use clap::Parser as _;

fn main() -> std::process::ExitCode {
    let cli = capture::cli::Cli::parse();
    // The agent logs its work; one-shot commands only their warnings. RUST_LOG overrides both.
    let default = if matches!(cli.command, capture::cli::Command::Agent(_)) {
        "info"
    } else {
        "warn"
    };
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default)),
        )
        .init();
    match capture::cli::run(cli) {
        Ok(capture::cli::Outcome::Success) => std::process::ExitCode::SUCCESS,
        Ok(capture::cli::Outcome::NotCaptured(reason)) => {
            eprintln!("capture: validate: {reason}");
            std::process::ExitCode::from(capture_user::validate::NOT_CAPTURED_EXIT)
        }
        Ok(capture::cli::Outcome::Refused(reason)) => {
            eprintln!("capture: {reason}");
            std::process::ExitCode::FAILURE
        }
        Err(e) => {
            // Library errors already carry their causes in their messages: print the top one only.
            eprintln!("capture: error: {e}");
            if let Some(hint) = capture_user::privileges::hint() {
                eprintln!("capture: {hint}");
            }
            std::process::ExitCode::FAILURE
        }
    }
}
