//! Polling helpers: wait until the real cluster reaches a state, or fail saying what was last seen.

use std::future::Future;
use std::time::Duration;

use anyhow::bail;

const POLL_INTERVAL: Duration = Duration::from_millis(200);

/// Calls `probe` until it returns `Ok(Some(value))`; fails after `timeout` with the last observation.
/// `probe` returns `Ok(None)` to keep waiting; `Err` ends the wait at once.
pub async fn until<T, F, Fut>(what: &str, timeout: Duration, mut probe: F) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = anyhow::Result<Option<T>>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if let Some(value) = probe().await? {
            return Ok(value);
        }
        if tokio::time::Instant::now() >= deadline {
            bail!("timed out after {timeout:?} waiting for {what}");
        }
        tokio::time::sleep(POLL_INTERVAL).await;
    }
}
