//! The grammar of a guest's console lines: the prefixes of stage 2's framing, of skips and of
//! xtask's own notes, libtest's result lines, and the noise (ANSI codes, printk) around them.

use super::model::Outcome;

/// Prefix of the lines xtask itself adds to a log (results.rs keeps them as notes).
pub const NOTE: &str = "capture-xtask: ";

/// Prefix of stage 2's framing lines.
pub const VM: &str = "capture-vm: ";
/// Prefix of a test's skip line.
pub const SKIP: &str = "capture-skip: ";

/// What follows `prefix` in `line`. Not only at the start: the firmware's last words (a screen
/// reset without a newline) may precede the guest's first line.
pub fn after<'a>(line: &'a str, prefix: &str) -> Option<&'a str> {
    line.find(prefix).map(|at| &line[at + prefix.len()..])
}

/// `raw` without ANSI escape sequences and control characters other than tabs (terminals' reset
/// sequences end in a shift-in, the serial console adds carriage returns).
pub fn clean(raw: &str) -> String {
    let mut out = String::with_capacity(raw.len());
    let mut chars = raw.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\u{1b}' => {
                // CSI: ESC [ parameters final-byte; any other escape: ESC and one character.
                if chars.next_if_eq(&'[').is_some() {
                    while chars
                        .next()
                        .is_some_and(|c| !('\u{40}'..='\u{7e}').contains(&c))
                    {}
                } else {
                    chars.next();
                }
            }
            c if c.is_control() && c != '\t' => {}
            c => out.push(c),
        }
    }
    out
}

/// The test name and its outcome of a libtest result line; `None` as outcome when the line ends
/// after the `...` (a printk cut it off: the outcome may follow on a line of its own).
pub fn test_line(line: &str) -> Option<(&str, Option<Outcome>)> {
    let rest = line.strip_prefix("test ")?;
    let (name, result) = rest.split_once(" ...")?;
    let name = name.strip_suffix(" - should panic").unwrap_or(name);
    if name.is_empty() || name.contains(char::is_whitespace) {
        return None;
    }
    Some((name, outcome_word(result)))
}

pub fn outcome_word(text: &str) -> Option<Outcome> {
    let text = text.trim();
    if text.starts_with("ok") {
        Some(Outcome::Pass)
    } else if text.starts_with("FAILED") {
        Some(Outcome::Fail)
    } else if text.starts_with("ignored") {
        Some(Outcome::Ignored)
    } else {
        None
    }
}

/// Whether `line` is a panic's first line (`thread 'NAME' panicked at FILE:LINE:COL:`); its
/// message follows on the next lines.
pub fn is_panic(line: &str) -> bool {
    line.contains("panicked at")
}

/// `line` up to a printk timestamp (`[   12.345678]`); `None` if it starts with one.
pub fn before_printk(line: &str) -> Option<&str> {
    let at = line.match_indices('[').map(|(i, _)| i).find(|&i| {
        let inner = line[i + 1..].split(']').next().unwrap_or("").trim_start();
        line[i + 1..].contains(']')
            && inner.split_once('.').is_some_and(|(s, us)| {
                !s.is_empty()
                    && s.bytes().all(|b| b.is_ascii_digit())
                    && us.len() == 6
                    && us.bytes().all(|b| b.is_ascii_digit())
            })
    });
    match at {
        Some(0) => None,
        Some(i) => Some(line[..i].trim_end()),
        None => Some(line),
    }
}
