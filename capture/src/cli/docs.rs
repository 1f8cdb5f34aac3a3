//! Shell completions and man pages, generated from the command line's own definition so that they
//! never drift from it: `capture generate-docs --out DIR` (hidden), which `cargo xtask
//! completions` runs. The xtask cannot generate them itself: it is built before setup installs
//! what capture-user's build needs (the kernel programs' toolchain).

use std::{
    io,
    path::{Path, PathBuf},
};

use clap::CommandFactory as _;
use clap_complete::Shell;

use super::args::Cli;

/// The shells completions are written for: `capture.bash`, `_capture` (zsh), `capture.fish`.
pub const SHELLS: [Shell; 3] = [Shell::Bash, Shell::Zsh, Shell::Fish];

/// Where under the output directory the man pages go (all of section 1: `capture.1`, ...), apart
/// from the completions, as a package installs them apart.
pub const MAN_DIR: &str = "man";

/// Writes the completions for [`SHELLS`] into `out` and a man page for `capture` and each of its
/// visible subcommands (`capture-attach.1`, ...) into `out/man`; the paths written, in that order.
pub fn generate(out: &Path) -> io::Result<Vec<PathBuf>> {
    let man_dir = out.join(MAN_DIR);
    std::fs::create_dir_all(&man_dir)?;
    let mut written = Vec::new();
    let mut shown = as_shown(&Cli::command());
    for shell in SHELLS {
        written.push(clap_complete::generate_to(shell, &mut shown, BIN, out)?);
    }
    // Built first, as clap_mangen's own generate_to does: building names each subcommand by its
    // page (`capture-attach`) and gives it the global options. No `help` subcommand: its page
    // would say nothing `capture --help` does not.
    let mut cli = Cli::command().disable_help_subcommand(true);
    cli.build();
    write_man_pages(&cli, &man_dir, &mut written)?;
    Ok(written)
}

/// Writes the pages of `cmd` and of its visible subcommands, recursively, into `dir`.
fn write_man_pages(cmd: &clap::Command, dir: &Path, written: &mut Vec<PathBuf>) -> io::Result<()> {
    // Every page's footer names the program and its version, as the root page's does by default
    // (a subcommand's would name only itself, with no version).
    let page =
        clap_mangen::Man::new(cmd.clone()).source(format!("{BIN} {}", env!("CAPTURE_VERSION")));
    written.push(page.generate_to(dir)?);
    for subcommand in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
        write_man_pages(subcommand, dir, written)?;
    }
    Ok(())
}

/// The binary's name, as the shells complete it.
const BIN: &str = "capture";

/// `cmd` as `--help` shows it: `clap_complete` offers every subcommand, hidden ones included
/// (`accel-cases`, run only by the acceleration checks, and `generate-docs`), so the completions
/// are generated from a copy without them. The copy keeps what completion reads: the name,
/// version, description, arguments and subcommands.
fn as_shown(cmd: &clap::Command) -> clap::Command {
    let mut shown = clap::Command::new(BIN)
        .version(env!("CAPTURE_VERSION"))
        .subcommand_required(cmd.is_subcommand_required_set())
        .args(cmd.get_arguments().cloned())
        .subcommands(cmd.get_subcommands().filter(|s| !s.is_hide_set()).cloned());
    if let Some(about) = cmd.get_about() {
        shown = shown.about(about.clone());
    }
    shown
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The subcommands `capture --help` lists, by name.
    fn visible_subcommands() -> Vec<String> {
        Cli::command()
            .get_subcommands()
            .filter(|s| !s.is_hide_set())
            .map(|s| s.get_name().to_string())
            .collect()
    }

    fn hidden_subcommands() -> Vec<String> {
        Cli::command()
            .get_subcommands()
            .filter(|s| s.is_hide_set())
            .map(|s| s.get_name().to_string())
            .collect()
    }

    /// Each completion script offers every visible subcommand and global option and no hidden
    /// subcommand; each visible subcommand has its man page, which names its own options.
    #[test]
    fn generate_writes_completions_and_a_man_page_per_visible_subcommand() {
        let out = std::env::temp_dir().join(format!("capture-docs-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&out);
        let written = generate(&out).unwrap();
        let visible = visible_subcommands();
        assert!(visible.len() > 10, "no subcommands found: {visible:?}");
        assert!(
            hidden_subcommands().contains(&"generate-docs".to_string()),
            "generate-docs must stay hidden"
        );

        for script in ["capture.bash", "_capture", "capture.fish"] {
            let path = out.join(script);
            assert!(
                written.contains(&path),
                "{script} not reported: {written:?}"
            );
            let text = std::fs::read_to_string(&path).unwrap();
            for name in &visible {
                assert!(text.contains(name.as_str()), "{script} lacks {name}");
            }
            // Fish names long options without their dashes (`-l state-dir`).
            for option in ["bpffs", "state-dir", "max-pods"] {
                assert!(text.contains(option), "{script} lacks {option}");
            }
            for name in hidden_subcommands() {
                assert!(
                    !text.contains(name.as_str()),
                    "{script} offers hidden {name}"
                );
            }
        }

        let man = out.join(MAN_DIR);
        let root = std::fs::read_to_string(man.join("capture.1")).unwrap();
        assert!(root.contains(".TH capture 1"), "{root}");
        for name in &visible {
            let page = man.join(format!("capture-{name}.1"));
            assert!(
                written.contains(&page),
                "no man page for {name}: {written:?}"
            );
            // roff escapes the hyphens of the names it lists.
            let listed = format!("capture\\-{}(1)", name.replace('-', "\\-"));
            assert!(root.contains(&listed), "capture.1 does not list {listed}");
            let text = std::fs::read_to_string(&page).unwrap();
            // Global options are propagated to every subcommand's page.
            assert!(text.contains("bpffs"), "{} lacks --bpffs", page.display());
        }
        for name in hidden_subcommands() {
            assert!(!man.join(format!("capture-{name}.1")).exists());
        }
        assert!(!man.join("capture-help.1").exists());
        let pages = written.iter().filter(|p| p.starts_with(&man)).count();
        assert_eq!(pages, visible.len() + 1, "{written:?}");
        std::fs::remove_dir_all(&out).unwrap();
    }

    /// The copy completions are generated from keeps every visible subcommand's arguments.
    #[test]
    fn the_shown_command_is_the_cli_without_hidden_subcommands() {
        let cli = Cli::command();
        let shown = as_shown(&cli);
        let names: Vec<String> = shown
            .get_subcommands()
            .map(|s| s.get_name().to_string())
            .collect();
        assert_eq!(names, visible_subcommands());
        let args = |cmd: &clap::Command| -> Vec<String> {
            cmd.get_arguments()
                .map(|a| a.get_id().to_string())
                .collect()
        };
        assert_eq!(args(&shown), args(&cli));
        assert_eq!(shown.get_about(), cli.get_about());
        assert_eq!(shown.get_version(), cli.get_version());
    }
}
