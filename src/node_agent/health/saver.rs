//! Saving the health book: off the async threads, always the latest book, again until it is on disk.
//!
//! A taint change is saved before it is published, so that an agent killed between the two reads the change back
//! instead of untainting the GPU at its first publish: publishing reads the book *shown* ([`Monitor::show`]), a copy
//! this saver sets once the copy is saved. But the save (a write and two fsyncs) must not hold up the agent: run on a
//! runtime thread with the book locked, a slow or hung state disk held the publish loop (which reads the book) and,
//! on a node whose agent has two runtime threads, the kubelet's calls. So one task saves, a copy of the book taken
//! under the lock, on a blocking thread; the copy is shown once it is saved, or after [`SLOW_SAVE`] when the disk has
//! not answered by then (the taint matters more than the record; `gpu_dra_node_agent_health_state_unsaved` is 1 from
//! then until a save succeeds), or once its save failed.
//!
//! A failed save (a full or read-only disk) is tried again, [`RETRY_FIRST`] doubling to [`RETRY_MAX`], until one
//! succeeds. Before, it was tried only at the next taint change, and an agent restarted meanwhile read the older
//! book and untainted a GPU that needed a reset.
//!
//! After an unreadable or missing saved state, nothing is saved until [`Monitor::restore`] has read the faults back
//! from the published taints (a save would replace the unreadable file with a book without them; the gauge is 1
//! for a change meanwhile); the first save after it copies an unreadable file aside, and its success ends the
//! restore. It is tried again as every save is: before, only at the next publish, which may not come for long.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::{Monitor, store};

/// How long a change waits for its save before it is published all the same.
pub(super) const SLOW_SAVE: Duration = Duration::from_secs(2);
/// The first wait before a failed save is tried again.
const RETRY_FIRST: Duration = Duration::from_secs(1);
/// The longest wait between tries.
const RETRY_MAX: Duration = Duration::from_secs(30);

/// What the monitor tells its saver, and what the saver shows.
#[derive(Debug, Default)]
pub(super) struct Saving {
    /// Woken for a taint change to save and then publish.
    wanted: Notify,
    /// Whether a change is wanted that no save has taken a copy of yet (looked at when the agent stops).
    pending: AtomicBool,
    /// 1 while the book on disk is older than the one published: its save failed or has not answered in
    /// [`SLOW_SAVE`].
    pub(super) unsaved: Gauge,
    /// Whether the last save failed (said once, not at every retry).
    failing: AtomicBool,
    /// Cancelled once the saver has made its last save at the agent's stop.
    pub(super) stopped: CancellationToken,
}

impl Saving {
    /// Asks for the book to be saved and then published.
    pub(super) fn want(&self) {
        self.pending.store(true, Ordering::Release);
        self.wanted.notify_one();
    }
}

impl Monitor {
    /// Saves the book whenever [`Saving::want`] asks, then shows it to the publisher (see the module's doc), until
    /// `stop`; a change not yet saved then gets one last try of at most [`SLOW_SAVE`].
    pub(super) async fn save_changes(self: Arc<Self>, stop: CancellationToken) {
        let mut retry_in: Option<Duration> = None;
        loop {
            let retry = async {
                match retry_in {
                    Some(wait) => tokio::time::sleep(wait).await,
                    None => std::future::pending().await,
                }
            };
            let for_change = tokio::select! {
                () = stop.cancelled() => break,
                () = self.saving.wanted.notified() => true,
                () = retry => false,
            };
            let saved = self.save_once(for_change).await;
            retry_in = match (saved, retry_in) {
                (true, _) => None,
                (false, None) => Some(RETRY_FIRST),
                (false, Some(wait)) => Some((wait * 2).min(RETRY_MAX)),
            };
        }
        if self.saving.pending.load(Ordering::Acquire) || retry_in.is_some() {
            let _ = tokio::time::timeout(SLOW_SAVE, self.save_once(false)).await;
        }
        self.saving.stopped.cancel();
    }

    /// Waits, at most `limit`, until the saver has made its last save after the agent's stop.
    pub async fn saved_at_stop(&self, limit: Duration) {
        let _ = tokio::time::timeout(limit, self.saving.stopped.cancelled()).await;
    }

    /// One save of a copy of the book, shown once saved (or late, or failed) when `for_change` (a retry's copy
    /// holds nothing not shown). Whether it saved.
    pub(super) async fn save_once(&self, for_change: bool) -> bool {
        let mut shown = !for_change;
        let mut again = false;
        let restoring = self.restore_pending();
        if self.read_back_pending() {
            // Not saved before the faults are read back (see `restore`): a save would replace the unreadable file
            // with a book without them. Published all the same; saved with them, once read back.
            self.saving.pending.store(false, Ordering::Release);
            self.show_live(true);
            if for_change {
                self.saving.unsaved.set(1);
            }
            return true;
        }
        let copy = {
            let book = self.book();
            self.saving.pending.store(false, Ordering::Release);
            book.clone()
        };
        let (dir, saving) = (self.state_dir.clone(), copy.clone());
        // The first save of the faults read back replaces an unreadable file: a copy is kept aside first, once.
        let keep_aside = (restoring && self.kept_note().is_none()).then_some(self.missing);
        let mut save = tokio::task::spawn_blocking(move || {
            let kept = keep_aside.map(|missing| Self::keep_aside(&dir, missing));
            (kept, store::save(&dir, &saving))
        });
        let slow_at = Instant::now() + SLOW_SAVE;
        let result = loop {
            tokio::select! {
                done = &mut save => break done,
                () = tokio::time::sleep_until(slow_at), if !shown => {
                    warn!(after = ?SLOW_SAVE, dir = %self.state_dir.display(),
                        "saving the GPU health state takes long (a slow or hung disk?); publishing the change first");
                    self.saving.unsaved.set(1);
                    self.show(copy.clone());
                    shown = true;
                }
                () = self.saving.wanted.notified() => {
                    // Saved after this save; shown now if this save is already late (it waits for nothing).
                    again = true;
                    if shown {
                        self.show_live(true);
                    }
                }
            }
        };
        if !shown {
            self.show(copy);
        }
        if again {
            self.saving.wanted.notify_one();
        }
        let result = match result {
            Ok((kept, saved)) => {
                if let Some((note, done)) = kept
                    && (done || saved.is_ok())
                {
                    *self.kept_note() = Some(note);
                }
                saved
            }
            Err(joined) => Err(store::StoreError::Write {
                path: store::path(&self.state_dir),
                source: std::io::Error::other(joined),
            }),
        };
        match result {
            Ok(()) => {
                if self.saving.failing.swap(false, Ordering::AcqRel) || self.saving.unsaved.get() != 0 {
                    info!("GPU health state saved again");
                }
                self.saving.unsaved.set(0);
                if restoring {
                    self.restore_saved();
                }
                true
            }
            Err(error) => {
                if self.saving.failing.swap(true, Ordering::AcqRel) {
                    debug!(%error, "GPU health state still not saved");
                } else {
                    warn!(%error, "GPU health state not saved; trying again until it is (a restart before then would \
                        forget the change)");
                }
                self.saving.unsaved.set(1);
                false
            }
        }
    }
}
