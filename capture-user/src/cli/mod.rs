//! The `capture` command line: its arguments (`args`), what each command does (`dispatch`) and
//! the text it prints for people (`render`).

mod args;
mod dispatch;
mod render;
mod values;

pub use args::{Cli, CniDirs, Command, MeshArgs};
pub use dispatch::{run, Outcome};
pub use render::{render_probe, render_status};
