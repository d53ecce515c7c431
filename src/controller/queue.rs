//! The work queue: deduplicated keys, one worker per key at a time, per-key exponential back-off.
//!
//! Informer handlers only put keys here; workers take them out, sync, and report `done`/`retry`. The semantics are
//! client-go's rate-limited work queue:
//! - a key queued twice is processed once;
//! - a key added while it is being processed is processed again afterwards, never concurrently;
//! - `retry` re-adds a key after 5 ms × 2^(failures−1), capped at 1,000 s, or later when retries of all keys
//!   together pass 10 a second (a bucket of 100): client-go's `DefaultTypedControllerRateLimiter`, the larger of
//!   the two, so that a webhook refusing every claim is asked 10 times a second, not once per failing pod;
//!   `forget` resets a key's failure count.
//!
//! It measures itself as client-go's queue does for kube-controller-manager's `workqueue_*` metrics
//! ([`QueueMetrics`]): adds of keys not already waiting, retries (every delayed add), the time from the first add
//! to the hand-out, the time from hand-out to `done`, and what is being processed right now.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::histogram::Histogram;
use tokio::sync::Notify;

/// First retry delay: small, so a conflict right after a write is retried at once.
const BASE_DELAY: Duration = Duration::from_millis(5);
/// Longest retry delay, as kube-controller-manager's.
const MAX_DELAY: Duration = Duration::from_secs(1000);
/// Retries of all keys together: 10 a second, 100 at once (client-go's overall `BucketRateLimiter`).
const RETRIES_PER_SECOND: f64 = 10.0;
const RETRY_BURST: f64 = 100.0;
/// Retries of refused keys ([`WorkQueue::retry_refused`]) as they come due: 10 a second, 10 at once.
const REFUSED_PER_SECOND: f64 = 10.0;
const REFUSED_BURST: f64 = 10.0;

/// A retry bucket: each retry takes a token, and waits for it when there is none (a reservation, as
/// `rate.Limiter.Reserve`: the wait grows with the retries already waiting).
#[derive(Debug)]
struct RetryBucket {
    rate: f64,
    burst: f64,
    tokens: f64,
    at: Instant,
}

/// The overall bucket of failures' retries.
impl Default for RetryBucket {
    fn default() -> Self {
        Self::new(RETRIES_PER_SECOND, RETRY_BURST)
    }
}

/// The bucket of refused keys' retries ([`WorkQueue::retry_refused`]).
#[derive(Debug)]
struct RefusedRetries(RetryBucket);

impl Default for RefusedRetries {
    fn default() -> Self {
        Self(RetryBucket::new(REFUSED_PER_SECOND, REFUSED_BURST))
    }
}

impl RetryBucket {
    fn new(rate: f64, burst: f64) -> Self {
        Self { rate, burst, tokens: burst, at: Instant::now() }
    }

    /// Takes a token at `now`; returns how long the retry waits for it.
    fn reserve(&mut self, now: Instant) -> Duration {
        let refill = now.saturating_duration_since(self.at).as_secs_f64() * self.rate;
        self.tokens = (self.tokens + refill).min(self.burst) - 1.0;
        self.at = self.at.max(now);
        if self.tokens >= 0.0 { Duration::ZERO } else { Duration::from_secs_f64(-self.tokens / self.rate) }
    }
}

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
    /// A `scheduling.k8s.io` PodGroup with claims of its own (only when that API is served).
    PodGroup(ObjectKey),
}

impl fmt::Display for WorkKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WorkKey::Pod(key) => write!(f, "pod:{key}"),
            WorkKey::Claim(key) => write!(f, "claim:{key}"),
            WorkKey::PodGroup(key) => write!(f, "podgroup:{key}"),
        }
    }
}

/// The queue's counters and histograms, shared with the metrics registry (clones count on the same values).
#[derive(Clone, Debug)]
pub struct QueueMetrics {
    /// Adds of keys that were not waiting already.
    pub adds: Counter,
    /// Delayed adds: retries after a failure and planned second looks (client-go counts every `AddAfter`).
    pub retries: Counter,
    /// Seconds from a key's first add to its hand-out to a worker.
    pub queue_duration: Histogram,
    /// Seconds from hand-out to `done`.
    pub work_duration: Histogram,
}

impl Default for QueueMetrics {
    fn default() -> Self {
        Self {
            adds: Counter::default(),
            retries: Counter::default(),
            queue_duration: Histogram::new(duration_buckets()),
            work_duration: Histogram::new(duration_buckets()),
        }
    }
}

/// client-go's work-queue buckets, `ExponentialBuckets(10e-9, 10, 10)`: 10 ns to 10 s, computed the same way
/// (each bucket the previous one times 10), so the bounds are the same floating-point numbers.
pub fn duration_buckets() -> impl Iterator<Item = f64> {
    std::iter::successors(Some(10e-9_f64), |bound| Some(bound * 10.0)).take(10)
}

/// What is being processed right now, for the `unfinished_work` and `longest_running_processor` gauges.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct InProgress {
    /// Seconds all keys being processed have been processed so far, summed.
    pub total_seconds: f64,
    /// Seconds the longest-running key has been processed.
    pub longest_seconds: f64,
}

/// Keys are held once, behind an `Arc` that `queue`, `dirty` and `processing` share: a backlog of 10,000 pods
/// puts some 20,000 keys here at once, and a pointer per entry instead of a copy keeps the tables a third the
/// size and the names allocated once.
#[derive(Default)]
struct State {
    queue: VecDeque<Arc<WorkKey>>,
    /// Keys waiting to be processed (in `queue`, or to be re-queued when their processing ends), with the time
    /// of their first add.
    dirty: HashMap<Arc<WorkKey>, Instant>,
    /// Keys being processed, with the time they were handed out.
    processing: HashMap<Arc<WorkKey>, Instant>,
    failures: HashMap<WorkKey, u32>,
    /// Refusals since its last successful sync of each key a quota refused ([`WorkQueue::retry_refused`]), apart
    /// from `failures`.
    refusals: HashMap<WorkKey, u32>,
    /// The one pending delayed add of each key: when it is due. A later delayed add of a key is dropped while an
    /// earlier one is pending, an earlier one replaces it (client-go's delaying queue keeps one entry per key), so
    /// a key that fails often never piles up timers.
    delayed: HashMap<WorkKey, Instant>,
    retries: RetryBucket,
    /// Paces refused keys as their retries come due, apart from `retries`.
    refused_retries: RefusedRetries,
    shut_down: bool,
    /// A standby replica's queue: keys are dropped, as no worker takes them (kube-controller-manager builds its
    /// queue only once it leads). The new leader queues what its caches show (`cache::enqueue_everything`).
    standing_by: bool,
}

/// A cloneable handle to one shared queue.
#[derive(Clone, Default)]
pub struct WorkQueue {
    state: Arc<Mutex<State>>,
    ready: Arc<Notify>,
    metrics: QueueMetrics,
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

    /// The queue's counters and histograms.
    pub fn metrics(&self) -> &QueueMetrics {
        &self.metrics
    }

    /// Queues `key` unless it is already waiting.
    pub fn add(&self, key: WorkKey) {
        let mut state = self.lock();
        if state.shut_down || state.standing_by || state.dirty.contains_key(&key) {
            return;
        }
        let key = Arc::new(key);
        state.dirty.insert(key.clone(), Instant::now());
        self.metrics.adds.inc();
        if !state.processing.contains_key(&key) {
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
                    let now = Instant::now();
                    if let Some(added) = state.dirty.remove(&*key) {
                        self.metrics.queue_duration.observe(now.duration_since(added).as_secs_f64());
                    }
                    let handed_out = WorkKey::clone(&key);
                    state.processing.insert(key, now);
                    if !state.queue.is_empty() {
                        self.ready.notify_one();
                    }
                    return Some(handed_out);
                }
            }
            notified.await;
        }
    }

    /// Drops every key added from now until [`WorkQueue::lead`]: on a replica that stands by, nothing would take
    /// them, and a queue of every pod and claim ever seen grows without bound (Jobs, rolling Deployments).
    pub fn stand_by(&self) {
        let mut state = self.lock();
        state.standing_by = true;
        state.queue.clear();
        state.dirty.clear();
        state.delayed.clear();
        state.failures.clear();
        state.refusals.clear();
    }

    /// Keeps keys again (see [`WorkQueue::stand_by`]).
    pub fn lead(&self) {
        self.lock().standing_by = false;
    }

    /// Starts the queue-time clock of every waiting key again: on becoming leader, keys queued before (without
    /// leader election, while the caches synced) count from now, as they would in kube-controller-manager, which
    /// queues them only once it leads.
    pub fn restart_clocks(&self) {
        let now = Instant::now();
        self.lock().dirty.values_mut().for_each(|added| *added = now);
    }

    /// Marks the processing of `key` finished; a key added meanwhile is queued again.
    pub fn done(&self, key: &WorkKey) {
        let mut state = self.lock();
        if let Some(started) = state.processing.remove(key) {
            self.metrics.work_duration.observe(started.elapsed().as_secs_f64());
        }
        if let Some((key, _)) = state.dirty.get_key_value(key) {
            let key = key.clone();
            state.queue.push_back(key);
            drop(state);
            self.ready.notify_one();
        }
    }

    /// Clears the failure and refusal counts of `key` after a successful sync.
    pub fn forget(&self, key: &WorkKey) {
        let mut state = self.lock();
        state.failures.remove(key);
        state.refusals.remove(key);
    }

    /// Re-adds `key` after its back-off delay; returns the delay.
    pub fn retry(&self, key: WorkKey) -> Duration {
        let delay = {
            let mut state = self.lock();
            let failures = state.failures.entry(key.clone()).or_insert(0);
            *failures = failures.saturating_add(1);
            let own = backoff(*failures);
            own.max(state.retries.reserve(Instant::now()))
        };
        self.add_after(key, delay);
        delay
    }

    /// Re-adds `key`, refused (a quota), after `first` doubled with each refusal since its last successful sync,
    /// capped at 1,000 s, and then once refused keys coming due together are within 10 a second (a bucket of their
    /// own, so they never hold back the retries of failures); returns the delay before that pacing. Its failure
    /// count is cleared: refusals do not build up the back-off a failure of another kind starts from. Before, every
    /// waiting pod of a Job a quota holds back was retried each `first` on its own: 3,000 of them took 50 refused
    /// creates a second, the whole default client limit.
    pub fn retry_refused(&self, key: WorkKey, first: Duration) -> Duration {
        let own = {
            let mut state = self.lock();
            state.failures.remove(&key);
            let refusals = state.refusals.entry(key.clone()).or_insert(0);
            *refusals = refusals.saturating_add(1);
            first.saturating_mul(1u32 << refusals.saturating_sub(1).min(31)).min(MAX_DELAY)
        };
        self.add_after_paced(key, own, true);
        own
    }

    /// Adds `key` after `delay` (a planned second look, not a failure: the back-off is untouched), unless an add of
    /// it is already due sooner.
    pub fn add_after(&self, key: WorkKey, delay: Duration) {
        self.add_after_paced(key, delay, false);
    }

    /// [`WorkQueue::add_after`]; `paced`: when due, it also waits for its turn among refused keys (10 a second).
    fn add_after_paced(&self, key: WorkKey, delay: Duration, paced: bool) {
        let due = Instant::now() + delay;
        {
            let mut state = self.lock();
            if state.shut_down || state.standing_by {
                return;
            }
            self.metrics.retries.inc();
            match state.delayed.get(&key) {
                Some(pending) if *pending <= due => return,
                _ => state.delayed.insert(key.clone(), due),
            };
        }
        let queue = self.clone();
        tokio::spawn(async move {
            tokio::time::sleep_until(due.into()).await;
            let turn = {
                let mut state = queue.lock();
                // Replaced by an earlier add that already fired, or by a newer one: that one adds the key.
                if state.delayed.get(&key) != Some(&due) {
                    return;
                }
                state.delayed.remove(&key);
                // Its turn is taken only now that it is due; a delayed add of the key meanwhile is one of its own.
                if paced { state.refused_retries.0.reserve(Instant::now()) } else { Duration::ZERO }
            };
            if !turn.is_zero() {
                tokio::time::sleep(turn).await;
            }
            queue.add(key);
        });
    }

    /// Keys waiting to be processed.
    pub fn depth(&self) -> usize {
        self.lock().queue.len()
    }

    /// Keys added and not handed out yet, those waiting for their current processing to end included: client-go's
    /// `workqueue_depth` (adds minus hand-outs).
    pub fn waiting(&self) -> usize {
        self.lock().dirty.len()
    }

    /// How long the keys being processed have been processed, now.
    pub fn in_progress(&self) -> InProgress {
        let now = Instant::now();
        self.lock().processing.values().fold(InProgress::default(), |acc, started| {
            let seconds = now.duration_since(*started).as_secs_f64();
            InProgress { total_seconds: acc.total_seconds + seconds, longest_seconds: acc.longest_seconds.max(seconds) }
        })
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

    #[test]
    fn retries_of_all_keys_together_wait_for_the_bucket() {
        let start = Instant::now();
        let mut bucket = RetryBucket { at: start, ..RetryBucket::default() };
        for _ in 0..100 {
            assert_eq!(bucket.reserve(start), Duration::ZERO);
        }
        let waits: Vec<u128> = (0..3).map(|_| bucket.reserve(start).as_millis()).collect();
        assert_eq!(waits, [100, 200, 300]);
        // 0.2 s later two tokens have come, both owed to the three waiting: the next waits 0.2 s.
        assert_eq!(bucket.reserve(start + Duration::from_millis(200)).as_millis(), 200);
        // Idle long enough, the bucket is full again, never fuller.
        let later = start + Duration::from_secs(60);
        assert_eq!(bucket.reserve(later), Duration::ZERO);
        assert!((bucket.tokens - (RETRY_BURST - 1.0)).abs() < 1e-9, "{}", bucket.tokens);
    }

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
    async fn a_standby_queue_keeps_nothing_until_it_leads() {
        let queue = WorkQueue::new();
        queue.stand_by();
        queue.add(pod("a"));
        queue.add_after(pod("b"), Duration::from_millis(1));
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(queue.depth(), 0);
        queue.lead();
        queue.add(pod("c"));
        assert_eq!(queue.depth(), 1);
        assert_eq!(queue.next().await, Some(pod("c")));
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
    async fn counts_what_client_go_counts() {
        let queue = WorkQueue::new();
        queue.add(pod("a"));
        queue.add(pod("a"));
        assert_eq!((queue.metrics().adds.get(), queue.waiting()), (1, 1), "a waiting key is not added twice");
        let key = queue.next().await.expect("key");
        assert_eq!(queue.waiting(), 0);
        queue.add(pod("a"));
        assert_eq!((queue.metrics().adds.get(), queue.waiting()), (2, 1), "added again while processing");
        std::thread::sleep(Duration::from_millis(5));
        let in_progress = queue.in_progress();
        assert!(in_progress.longest_seconds >= 0.005, "{in_progress:?}");
        assert!(in_progress.total_seconds >= in_progress.longest_seconds, "{in_progress:?}");
        queue.done(&key);
        assert_eq!(queue.in_progress(), InProgress::default(), "nothing in progress after done");
        queue.retry(pod("b"));
        assert_eq!(queue.metrics().retries.get(), 1);
    }

    #[test]
    fn buckets_are_client_go_s() {
        let buckets: Vec<f64> = duration_buckets().collect();
        assert_eq!(buckets.len(), 10);
        assert_eq!(buckets[0], 1e-8);
        // Go: next *= 10, starting at 10e-9; the last bound is 10 s (to the last bit, as computed there).
        assert!((buckets[9] - 10.0).abs() < 1e-12, "{buckets:?}");
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
    async fn a_key_has_one_pending_delayed_add_the_soonest() {
        let queue = WorkQueue::new();
        queue.add_after(pod("a"), Duration::from_secs(60));
        queue.add_after(pod("a"), Duration::from_secs(90));
        queue.add_after(pod("a"), Duration::from_secs(30));
        assert_eq!(queue.lock().delayed.len(), 1);
        tokio::time::sleep(Duration::from_secs(31)).await;
        assert_eq!(queue.next().await, Some(pod("a")), "the soonest fired");
        queue.done(&pod("a"));
        tokio::time::sleep(Duration::from_secs(61)).await;
        assert_eq!(queue.depth(), 0, "the later ones were dropped, not fired as well");
        assert!(queue.lock().delayed.is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn refused_keys_wait_longer_each_time_and_come_due_ten_a_second() {
        let queue = WorkQueue::new();
        let minute = Duration::from_secs(60);
        let delays: Vec<u64> = (0..6).map(|_| queue.retry_refused(pod("a"), minute).as_secs()).collect();
        assert_eq!(delays, [60, 120, 240, 480, 960, 1000], "doubling from the first, capped as every back-off");
        assert_eq!(queue.retry(pod("a")), Duration::from_millis(5), "refusals build no back-off of failures");
        assert_eq!(queue.retry_refused(pod("a"), minute).as_secs(), 1000, "a failure between keeps the refusals");
        queue.forget(&pod("a"));
        assert_eq!(queue.retry_refused(pod("a"), minute), minute, "a success starts again");

        // A Job of 3,000 pods a quota refused at once: when their retries come due, they are let into the queue 10 a
        // second (10 at once), not all together, and the failures' bucket is left whole.
        let queue = WorkQueue::new();
        for i in 0..3000 {
            queue.retry_refused(pod(&format!("p{i}")), minute);
        }
        tokio::time::sleep(Duration::from_secs(59)).await;
        assert_eq!(queue.depth(), 0);
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let first = queue.depth();
        assert!((10..=26).contains(&first), "{first} let in within 0.5 s of coming due");
        tokio::time::sleep(Duration::from_secs(100)).await;
        let later = queue.depth();
        assert!((1000..=1030).contains(&later), "{later} let in 100 s later");
        tokio::time::sleep(Duration::from_secs(200)).await;
        assert_eq!(queue.depth(), 3000);
        assert_eq!(queue.retry(pod("other")), Duration::from_millis(5), "a failure's retry waits for no refused key");
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
