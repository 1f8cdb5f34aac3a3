//! The `capture` command line: its arguments (`args`), what each command does (`dispatch`) and
//! the text it prints for people (`render`); its completions and man pages (`docs`).

mod args;
mod dispatch;
mod docs;
mod render;
mod render_doctor;
mod values;

pub use args::{Cli, CniDirs, Command, MeshArgs};
pub use dispatch::{run, Outcome};
pub use render::render_status;
pub use render_doctor::render_probe;
