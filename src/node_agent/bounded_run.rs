//! Running a helper program (the driver's `nvidia-smi`, the MPS control client) for an answer, never for longer than
//! a limit: the agent runs them under its prepare lock, and a wedged GPU can hang them in the kernel.

use std::io::{Read, Write};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::thread::JoinHandle;
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
    let [stdout, stderr] = outputs.map(|reader| reader.join().unwrap_or_default());
    Ok(Outcome::Exited { status, stdout, stderr })
}

/// Reads a pipe to its end on a thread of its own.
fn drain(pipe: Option<impl Read + Send + 'static>) -> JoinHandle<String> {
    std::thread::spawn(move || {
        let mut text = String::new();
        if let Some(mut pipe) = pipe {
            let _ = pipe.read_to_string(&mut text);
        }
        text
    })
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
        let mut hung = Command::new("/bin/sh");
        hung.args(["-c", "exec sleep 30"]);
        let started = Instant::now();
        assert!(matches!(run(hung, None, Duration::from_millis(200))?, Outcome::TimedOut));
        assert!(started.elapsed() < Duration::from_secs(5), "took {:?}", started.elapsed());
        Ok(())
    }
}
