//! How fast this machine is, as one figure: the wall time of a fixed, CPU-bound piece of work of
//! the kind CI mostly does (compiling), so that a run's total can be judged against the budget
//! whatever machine it got. The work is `rustc -O` of a generated program, always the same,
//! with one codegen unit: one core's speed.

use std::{
    path::Path,
    process::Command,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result};

use crate::run;

/// Functions in the generated program: about 4 s on the reference machine.
const FUNCTIONS: usize = 60;

/// The program compiled: `FUNCTIONS` functions over iterator chains and a few generic
/// instantiations each, which keep the optimizer busy, and a `main` that calls them all.
pub fn source() -> String {
    let mut text = String::from(
        "use std::collections::BTreeMap;\n\
         fn mix<T: Copy + Into<u64>>(xs: &[T], seed: u64) -> u64 {\n\
         \x20   xs.iter().fold(seed, |a, x| a.rotate_left(7) ^ (*x).into().wrapping_mul(0x9e37_79b9))\n\
         }\n",
    );
    for i in 0..FUNCTIONS {
        text.push_str(&format!(
            "pub fn f{i}(n: u64) -> u64 {{\n\
             \x20   let v: Vec<u64> = (0..n).map(|k| k.wrapping_mul({m}) ^ {i}).filter(|k| k % 3 != {r}).collect();\n\
             \x20   let w: Vec<u32> = v.iter().map(|k| (*k >> 7) as u32).rev().collect();\n\
             \x20   let mut m: BTreeMap<u64, String> = BTreeMap::new();\n\
             \x20   for (j, k) in v.iter().enumerate().take(16) {{ m.insert(*k, format!(\"{{j}}-{{k}}\")); }}\n\
             \x20   mix(&v, {i}) ^ mix(&w, n) ^ m.values().map(|s| s.len() as u64).sum::<u64>()\n\
             }}\n",
            m = 2_654_435_761u64 + i as u64,
            r = i % 3
        ));
    }
    text.push_str("fn main() {\n    let mut t = 0u64;\n");
    for i in 0..FUNCTIONS {
        text.push_str(&format!("    t ^= f{i}(64);\n"));
    }
    text.push_str("    println!(\"{t}\");\n}\n");
    text
}

/// Compiles the program in `dir` and returns how long it took.
pub fn measure(dir: &Path) -> Result<Duration> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let src = dir.join("calibration.rs");
    std::fs::write(&src, source())?;
    let started = Instant::now();
    run(Command::new("rustc")
        .args([
            "--edition",
            "2021",
            "-C",
            "opt-level=2",
            "-C",
            "codegen-units=1",
        ])
        .arg("-o")
        .arg(dir.join("calibration"))
        .arg(&src))?;
    Ok(started.elapsed())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_program_is_always_the_same() {
        let text = source();
        assert_eq!(text, source());
        assert_eq!(text.matches("pub fn f").count(), FUNCTIONS);
    }
}
