//! Running a helper program (the driver's `nvidia-smi`, the MPS control client) for an answer, never for longer than
//! a limit: the agent runs them under its prepare lock, and a wedged GPU can hang them in the kernel.

use std::io::{Read, Write};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::Receiver;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

/// How a bounded run ended.
#[derive(Debug)]
pub enum Outcome {
    Exited {
        status: ExitStatus,
        stdout: String,
        stderr: String,
    },
    /// Still running at the limit: it was killed (and is reaped on a thread of its own).
    TimedOut,
}

/// Runs `command` with `input` on its standard input (then closed), its output read as it comes (so no amount of it
/// can block the program), and kills it at `limit`. Errors are the spawn's or the wait's.
pub fn run(mut command: Command, input: Option<&[u8]>, limit: Duration) -> std::io::Result<Outcome> {
    let stdin = if input.is_some() { Stdio::piped() } else { Stdio::null() };
    command.stdin(stdin).stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = command.spawn()?;
    if let (Some(mut pipe), Some(input)) = (child.stdin.take(), input) {
        // A program that exits before reading gets the rest of its handling below (its status and output).
        let _ = pipe.write_all(input);
    }
    let outputs = [drain(child.stdout.take()), drain(child.stderr.take())];
    let status = match wait_at_most(&mut child, limit) {
        Ok(Some(status)) => status,
        Ok(None) => {
            give_up(child);
            return Ok(Outcome::TimedOut);
        }
        Err(e) => {
            give_up(child);
            return Err(e);
        }
    };
    let until = Instant::now() + OUTPUT_AFTER_EXIT;
    let [stdout, stderr] = outputs.map(|output| output.take(until));
    Ok(Outcome::Exited { status, stdout, stderr })
}

/// How long the output of a program that exited may take to reach its end.
const OUTPUT_AFTER_EXIT: Duration = Duration::from_secs(1);

/// A pipe being read on a thread of its own.
struct Drained {
    /// What was read; `None` once taken (the reader then drops what still comes).
    read: Arc<Mutex<Option<Vec<u8>>>>,
    ended: Receiver<()>,
}

impl Drained {
    /// What was read once the pipe ended, or at `until` (shortly after the program exited): a descendant left
    /// running may hold the pipe open, and what came by then is what there is.
    fn take(self, until: Instant) -> String {
        let _ = self.ended.recv_timeout(until.saturating_duration_since(Instant::now()));
        let read = self.read.lock().unwrap_or_else(PoisonError::into_inner).take().unwrap_or_default();
        String::from_utf8_lossy(&read).into_owned()
    }
}

/// Reads a pipe as its output comes, on a thread of its own.
fn drain(pipe: Option<impl Read + Send + 'static>) -> Drained {
    let read = Arc::new(Mutex::new(Some(Vec::new())));
    let (ended, receive) = std::sync::mpsc::channel();
    let into = read.clone();
    std::thread::spawn(move || {
        if let Some(mut pipe) = pipe {
            let mut chunk = [0u8; 4096];
            loop {
                match pipe.read(&mut chunk) {
                    Ok(0) => break,
                    Ok(n) => {
                        if let Some(read) = into.lock().unwrap_or_else(PoisonError::into_inner).as_mut() {
                            read.extend_from_slice(&chunk[..n]);
                        }
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(_) => break,
                }
            }
        }
        let _ = ended.send(());
    });
    Drained { read, ended: receive }
}

/// The child's exit status, or `None` when it has not exited within `limit`.
fn wait_at_most(child: &mut Child, limit: Duration) -> std::io::Result<Option<ExitStatus>> {
    let started = Instant::now();
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(Some(status));
        }
        if started.elapsed() >= limit {
            return Ok(None);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Kills a child that overran and reaps it on a thread of its own: one stuck in the kernel may not die at once.
fn give_up(mut child: Child) {
    let _ = child.kill();
    std::thread::spawn(move || child.wait());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn output_input_and_limit() -> std::io::Result<()> {
        let mut echo = Command::new("/bin/sh");
        echo.args(["-c", "read line; echo got $line; echo oops >&2; exit 3"]);
        let Outcome::Exited { status, stdout, stderr } = run(echo, Some(b"quit\n"), Duration::from_secs(10))? else {
            panic!("timed out");
        };
        assert_eq!((status.code(), stdout.as_str(), stderr.as_str()), (Some(3), "got quit\n", "oops\n"));
        // A program that exits leaving a child with its output open is answered all the same.
        let mut detached = Command::new("/bin/sh");
        detached.args(["-c", "echo before; sleep 30 & exit 0"]);
        let started = Instant::now();
        let Outcome::Exited { stdout, .. } = run(detached, None, Duration::from_secs(10))? else {
            panic!("timed out");
        };
        assert_eq!(stdout, "before\n");
        assert!(started.elapsed() < Duration::from_secs(5), "took {:?}", started.elapsed());
        let mut hung = Command::new("/bin/sh");
        hung.args(["-c", "exec sleep 30"]);
        let started = Instant::now();
        assert!(matches!(run(hung, None, Duration::from_millis(200))?, Outcome::TimedOut));
        assert!(started.elapsed() < Duration::from_secs(5), "took {:?}", started.elapsed());
        Ok(())
    }
}
