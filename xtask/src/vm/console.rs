//! One VM's console: every line goes to target/vm/logs/<kernel>.<shard>.log and into memory for
//! results.rs, and the framing lines show progress on the terminal. `stream` feeds it from a
//! child's output under a deadline, so a hung guest or test costs its time limit, never the run.

use std::{
    fs::File,
    io::{BufRead as _, BufReader, BufWriter, Read, Write as _},
    os::unix::process::ExitStatusExt as _,
    path::Path,
    process::Child,
    sync::mpsc,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result};

use super::{
    lines::{after, before_printk, clean, is_panic, test_line, NOTE, VM},
    model::{Outcome, TestBinary},
};

/// How often the deadline and the child are checked while no output comes.
const TICK: Duration = Duration::from_millis(200);
/// How long output is still read after the child exited: its own children may hold the pipe.
const DRAIN: Duration = Duration::from_secs(2);
/// How long a guest that said `done` gets to power off before it is killed.
const AFTER_DONE: Duration = Duration::from_secs(30);
/// Lines of a panic's message said on the terminal after its `panicked at` line: CI keeps only
/// the terminal, and a failure's reason must be in it, not only in the VM's log.
const PANIC_LINES: usize = 8;

pub struct Finished {
    pub text: String,
    /// Seconds from the start to the end.
    pub seconds: f64,
    /// Seconds from the start to the `kernel` line.
    pub boot_seconds: Option<f64>,
    /// Wall-clock seconds of each binary, between its begin and end lines.
    pub binary_seconds: Vec<(String, f64)>,
}

pub struct Console {
    label: String,
    log: BufWriter<File>,
    text: String,
    start: Instant,
    boot_seconds: Option<f64>,
    binary_seconds: Vec<(String, f64)>,
    running: Option<(String, Instant, usize, usize)>,
    /// Lines of a panic's message still to say on the terminal.
    panic_lines_left: usize,
    /// Every line said on the terminal, in order.
    said: Vec<String>,
    done: bool,
}

impl Console {
    pub fn create(log: &Path, label: &str) -> Result<Self> {
        let file = File::create(log).with_context(|| format!("creating {}", log.display()))?;
        Ok(Self {
            label: label.to_string(),
            log: BufWriter::new(file),
            text: String::new(),
            start: Instant::now(),
            boot_seconds: None,
            binary_seconds: Vec::new(),
            running: None,
            panic_lines_left: 0,
            said: Vec::new(),
            done: false,
        })
    }

    /// Records one line of output (a trailing newline and carriage return are dropped).
    pub fn line(&mut self, raw: &str) -> Result<()> {
        let raw = raw.trim_end_matches(['\n', '\r']);
        writeln!(self.log, "{raw}")?;
        self.text.push_str(raw);
        self.text.push('\n');
        let cleaned = clean(raw);
        if cleaned.contains("Kernel panic") {
            self.say(&cleaned);
        } else if let Some(line) = before_printk(&cleaned) {
            self.progress(line);
        }
        Ok(())
    }

    /// Adds a line of xtask's own to the log, and says it on the terminal.
    pub fn note(&mut self, what: &str) -> Result<()> {
        self.say(what);
        self.line(&format!("{NOTE}{what}"))
    }

    pub fn elapsed(&self) -> f64 {
        self.start.elapsed().as_secs_f64()
    }

    /// The whole log and the timings, for results.rs. A binary still running (the kernel hung
    /// or died under it) counts until now.
    pub fn finish(mut self) -> Result<Finished> {
        self.log.flush()?;
        if let Some((name, began, _, _)) = self.running.take() {
            self.binary_seconds
                .push((name, began.elapsed().as_secs_f64()));
        }
        Ok(Finished {
            seconds: self.elapsed(),
            text: self.text,
            boot_seconds: self.boot_seconds,
            binary_seconds: self.binary_seconds,
        })
    }

    /// The lines said on the terminal so far, without their label and time.
    #[cfg(test)]
    pub fn said(&self) -> &[String] {
        &self.said
    }

    fn say(&mut self, what: &str) {
        println!("[{} +{:.1}s] {what}", self.label, self.elapsed());
        self.said.push(what.to_string());
    }

    fn progress(&mut self, line: &str) {
        if is_panic(line) {
            self.say(&format!("    {line}"));
            self.panic_lines_left = PANIC_LINES;
            return;
        }
        if self.panic_lines_left > 0 {
            if line.trim().is_empty() || line.starts_with("note: ") {
                self.panic_lines_left = 0;
            } else {
                self.panic_lines_left -= 1;
                self.say(&format!("    {line}"));
                return;
            }
        }
        if let Some(rest) = after(line, VM) {
            let mut words = rest.split_whitespace();
            match (words.next(), words.next()) {
                (Some("kernel"), Some(release)) => {
                    self.boot_seconds = Some(self.elapsed());
                    self.say(&format!("kernel {release} up"));
                }
                (Some("begin"), Some(name)) => {
                    self.say(&format!("{name}: started"));
                    self.running = Some((name.to_string(), Instant::now(), 0, 0));
                }
                (Some("end"), Some(name)) => {
                    if let Some((_, began, passed, failed)) = self.running.take() {
                        let seconds = began.elapsed().as_secs_f64();
                        self.binary_seconds.push((name.to_string(), seconds));
                        let rc = words.next().unwrap_or("rc=?");
                        self.say(&format!(
                            "{name}: {rc} after {seconds:.1} s ({passed} passed, {failed} failed)"
                        ));
                    }
                }
                (Some("done"), None) => self.done = true,
                _ => self.say(line),
            }
        } else if let Some((name, Some(outcome))) = test_line(line) {
            let mut failure = None;
            if let Some((binary, _, passed, failed)) = &mut self.running {
                match outcome {
                    Outcome::Pass => *passed += 1,
                    Outcome::Fail => {
                        *failed += 1;
                        let name = TestBinary::short(binary, name);
                        failure = Some(format!("  FAILED {binary}::{name}"));
                    }
                    _ => {}
                }
            }
            if let Some(what) = failure {
                self.say(&what);
            }
        }
    }
}

/// How a streamed child ended.
pub enum Ended {
    /// Its exit code, or 128 + the signal that killed it (as a shell reports it).
    Exited(i32),
    /// The deadline passed; the child was killed.
    TimedOut,
}

/// Kills the child when dropped unless it has been reaped, so an error on the way out never
/// leaves a qemu or a test binary running.
pub struct Guard(pub Child);

impl Drop for Guard {
    fn drop(&mut self) {
        if matches!(self.0.try_wait(), Ok(None)) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

/// Feeds `out` (the child's merged stdout and stderr) to the console until the child exits,
/// killing it at `deadline`, or 30 s after its console said `done`.
pub fn stream(
    child: &mut Child,
    out: impl Read + Send + 'static,
    deadline: Instant,
    console: &mut Console,
) -> Result<Ended> {
    let (tx, rx) = mpsc::channel::<Vec<u8>>();
    // Detached: after a kill it ends at EOF; if a grandchild keeps the pipe, it ends with it.
    std::thread::spawn(move || {
        let mut reader = BufReader::new(out);
        loop {
            let mut buf = Vec::new();
            match reader.read_until(b'\n', &mut buf) {
                Ok(0) | Err(_) => break,
                Ok(_) if tx.send(buf).is_err() => break,
                Ok(_) => {}
            }
        }
    });
    let mut open = true;
    let mut exited: Option<(i32, Instant)> = None;
    let mut done_at: Option<Instant> = None;
    loop {
        if exited.is_none() {
            if let Some(status) = child.try_wait()? {
                let code = status
                    .code()
                    .or(status.signal().map(|s| 128 + s))
                    .unwrap_or(-1);
                exited = Some((code, Instant::now()));
            }
        }
        if let Some((code, at)) = exited {
            if !open || at.elapsed() > DRAIN {
                return Ok(Ended::Exited(code));
            }
        }
        if exited.is_none() && Instant::now() >= deadline {
            child.kill()?;
            child.wait()?;
            return Ok(Ended::TimedOut);
        }
        if done_at.is_some_and(|at| at.elapsed() > AFTER_DONE) && exited.is_none() {
            console.note("the guest did not power off after `done`; killed it")?;
            child.kill()?;
            child.wait()?;
            return Ok(Ended::Exited(-1));
        }
        if open {
            match rx.recv_timeout(TICK) {
                Ok(bytes) => console.line(&String::from_utf8_lossy(&bytes))?,
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => open = false,
            }
        } else {
            std::thread::sleep(TICK);
        }
        if console.done && done_at.is_none() {
            done_at = Some(Instant::now());
        }
    }
}
