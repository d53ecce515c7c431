//! The work queue: deduplicated keys, one worker per key at a time, per-key exponential back-off.
//!
//! Informer handlers only put keys here; workers take them out, sync, and report `done`/`retry`. The semantics are
//! client-go's rate-limited work queue:
//! - a key queued twice is processed once;
//! - a key added while it is being processed is processed again afterwards, never concurrently;
//! - `retry` re-adds a key after 5 ms × 2^(failures−1), capped at 1,000 s; `forget` resets its failure count.

use std::collections::{HashMap, HashSet, VecDeque};
use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::Notify;

/// First retry delay: small, so a conflict right after a write is retried at once.
const BASE_DELAY: Duration = Duration::from_millis(5);
/// Longest retry delay, as kube-controller-manager's.
const MAX_DELAY: Duration = Duration::from_secs(1000);

/// A namespaced object's key.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ObjectKey {
    pub namespace: String,
    pub name: String,
}

impl ObjectKey {
    pub fn new(namespace: impl Into<String>, name: impl Into<String>) -> Self {
        Self { namespace: namespace.into(), name: name.into() }
    }
}

impl fmt::Display for ObjectKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// What a worker syncs.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum WorkKey {
    Pod(ObjectKey),
    Claim(ObjectKey),
}

impl fmt::Display for WorkKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WorkKey::Pod(key) => write!(f, "pod:{key}"),
            WorkKey::Claim(key) => write!(f, "claim:{key}"),
        }
    }
}

#[derive(Default)]
struct State {
    queue: VecDeque<WorkKey>,
    /// Keys waiting to be processed (in `queue`, or to be re-queued when their processing ends).
    dirty: HashSet<WorkKey>,
    processing: HashSet<WorkKey>,
    failures: HashMap<WorkKey, u32>,
    shut_down: bool,
}

/// A cloneable handle to one shared queue.
#[derive(Clone, Default)]
pub struct WorkQueue {
    state: Arc<Mutex<State>>,
    ready: Arc<Notify>,
}

impl fmt::Debug for WorkQueue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WorkQueue").field("depth", &self.depth()).finish()
    }
}

impl WorkQueue {
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // The state stays consistent across a panicking holder: every method leaves it whole before returning.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Queues `key` unless it is already waiting.
    pub fn add(&self, key: WorkKey) {
        let mut state = self.lock();
        if state.shut_down || !state.dirty.insert(key.clone()) {
            return;
        }
        if !state.processing.contains(&key) {
            state.queue.push_back(key);
            drop(state);
            self.ready.notify_one();
        }
    }

    /// Waits for the next key; `None` once the queue is shut down.
    pub async fn next(&self) -> Option<WorkKey> {
        loop {
            let notified = self.ready.notified();
            {
                let mut state = self.lock();
                if state.shut_down {
                    return None;
                }
                if let Some(key) = state.queue.pop_front() {
                    state.dirty.remove(&key);
                    state.processing.insert(key.clone());
                    if !state.queue.is_empty() {
                        self.ready.notify_one();
                    }
                    return Some(key);
                }
            }
            notified.await;
        }
    }

    /// Marks the processing of `key` finished; a key added meanwhile is queued again.
    pub fn done(&self, key: &WorkKey) {
        let mut state = self.lock();
        state.processing.remove(key);
        if state.dirty.contains(key) {
            state.queue.push_back(key.clone());
            drop(state);
            self.ready.notify_one();
        }
    }

    /// Clears the failure count of `key` after a successful sync.
    pub fn forget(&self, key: &WorkKey) {
        self.lock().failures.remove(key);
    }

    /// Re-adds `key` after its back-off delay; returns the delay.
    pub fn retry(&self, key: WorkKey) -> Duration {
        let delay = {
            let mut state = self.lock();
            let failures = state.failures.entry(key.clone()).or_insert(0);
            *failures = failures.saturating_add(1);
            backoff(*failures)
        };
        self.add_after(key, delay);
        delay
    }

    /// Adds `key` after `delay` (a planned second look, not a failure: the back-off is untouched).
    pub fn add_after(&self, key: WorkKey, delay: Duration) {
        let queue = self.clone();
        tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            queue.add(key);
        });
    }

    /// Keys waiting to be processed.
    pub fn depth(&self) -> usize {
        self.lock().queue.len()
    }

    /// Stops handing out keys; waiting workers get `None`.
    pub fn shut_down(&self) {
        self.lock().shut_down = true;
        self.ready.notify_waiters();
    }
}

/// 5 ms × 2^(failures−1), capped at [`MAX_DELAY`].
fn backoff(failures: u32) -> Duration {
    let exponent = failures.saturating_sub(1).min(31);
    BASE_DELAY.saturating_mul(1u32 << exponent).min(MAX_DELAY)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(name: &str) -> WorkKey {
        WorkKey::Pod(ObjectKey::new("ns", name))
    }

    #[test]
    fn backoff_doubles_up_to_the_cap() {
        assert_eq!(backoff(1), Duration::from_millis(5));
        assert_eq!(backoff(2), Duration::from_millis(10));
        assert_eq!(backoff(11), Duration::from_millis(5120));
        assert_eq!(backoff(30), MAX_DELAY);
        assert_eq!(backoff(u32::MAX), MAX_DELAY);
    }

    #[tokio::test]
    async fn duplicate_adds_are_processed_once() {
        let queue = WorkQueue::new();
        queue.add(pod("a"));
        queue.add(pod("a"));
        queue.add(pod("b"));
        assert_eq!(queue.depth(), 2);
        assert_eq!(queue.next().await, Some(pod("a")));
        assert_eq!(queue.next().await, Some(pod("b")));
        assert_eq!(queue.depth(), 0);
    }

    #[tokio::test]
    async fn a_key_added_while_processing_waits_until_done() {
        let queue = WorkQueue::new();
        queue.add(pod("a"));
        let key = queue.next().await;
        queue.add(pod("a"));
        assert_eq!(queue.depth(), 0, "must not be handed to a second worker while processing");
        queue.done(&pod("a"));
        assert_eq!(queue.depth(), 1);
        assert_eq!(queue.next().await, key);
    }

    #[tokio::test]
    async fn shut_down_wakes_waiting_workers() {
        let queue = WorkQueue::new();
        let waiter = tokio::spawn({
            let queue = queue.clone();
            async move { queue.next().await }
        });
        tokio::task::yield_now().await;
        queue.shut_down();
        assert_eq!(waiter.await.ok().flatten(), None);
    }

    #[tokio::test(start_paused = true)]
    async fn retry_re_adds_after_growing_delays_and_forget_resets() {
        let queue = WorkQueue::new();
        assert_eq!(queue.retry(pod("a")), Duration::from_millis(5));
        assert_eq!(queue.retry(pod("a")), Duration::from_millis(10));
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(queue.next().await, Some(pod("a")));
        queue.done(&pod("a"));
        queue.forget(&pod("a"));
        assert_eq!(queue.retry(pod("a")), Duration::from_millis(5));
    }
}
