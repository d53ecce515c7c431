//! Which unprepare overtook which prepare: a prepare asked before its claim was unprepared must not be done after.
//!
//! The kubelet records a pod's claim before it calls NodePrepareResources and gives up on the call after 45 s
//! (`defaultClientCallTimeout`, `pkg/kubelet/cm/dra/plugin`). The agent may still be working on it then: waiting
//! for the claim's API read (a slow or restarting API server), or for the state lock behind a prepare stuck on the
//! disk. Meanwhile the pod is deleted and the kubelet unprepares the claim (the pod's termination, or its
//! `reconcileLoop` for pods no longer active); the agent, holding nothing for it yet, answers that at once, and the
//! kubelet forgets the claim. Done after that, the late prepare would leave the claim prepared with nobody left to
//! unprepare it: its spec on disk, an MPS daemon running, a MIG device made, and its GPUs refused to every later
//! claim ("already prepared for claim …") until the node reboots.
//!
//! So every prepare takes a [`Ticket`] when it arrives, which travels with its queued work; an unprepare records,
//! for each claim it was asked, the newest ticket handed out by the time it is done; a prepare whose claim was
//! unprepared at or after its own ticket is refused instead of done. A kubelet that still wants the claim asks
//! again, after the unprepare, and gets it. The kubelet itself refuses to prepare a claim it is unpreparing (since
//! 1.37), so a prepare asked after an unprepare is never overtaken the other way round.
//!
//! Pure bookkeeping, no I/O. What is recorded lives only while a ticket that could be overtaken is out: at most one
//! number per claim unprepared while prepares were in flight.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

/// The order of prepares and unprepares, shared by the gRPC calls and the commits that do their work.
#[derive(Debug, Default, Clone)]
pub struct CallOrder {
    inner: Arc<Mutex<Inner>>,
}

#[derive(Debug, Default)]
struct Inner {
    /// The last ticket handed out.
    last: u64,
    /// The tickets out.
    out: BTreeSet<u64>,
    /// For each claim unprepared while tickets were out: the last ticket handed out when it was.
    unprepared: HashMap<String, u64>,
}

/// A prepare's place in the order, from its arrival until its work is done (or dropped). Dropping it forgets what
/// only it could be overtaken by.
#[derive(Debug)]
pub struct Ticket {
    number: u64,
    order: CallOrder,
}

impl CallOrder {
    /// A prepare arrives.
    pub fn arrive(&self) -> Ticket {
        let mut inner = self.lock();
        inner.last += 1;
        let number = inner.last;
        inner.out.insert(number);
        Ticket { number, order: self.clone() }
    }

    /// The claim `uid` was unprepared (or its unprepare was done, whatever its outcome): every prepare of it that
    /// arrived before now is overtaken.
    pub fn unprepared(&self, uid: &str) {
        let mut inner = self.lock();
        if inner.out.is_empty() {
            // No prepare is in flight: there is nothing to overtake.
            return;
        }
        let last = inner.last;
        inner.unprepared.insert(uid.to_string(), last);
    }

    /// Claims recorded as unprepared, for tests of the pruning.
    #[cfg(test)]
    fn recorded(&self) -> usize {
        self.lock().unprepared.len()
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Ticket {
    /// Whether the claim `uid` was unprepared after this prepare arrived.
    pub fn overtaken(&self, uid: &str) -> bool {
        self.order.lock().unprepared.get(uid).is_some_and(|&at| at >= self.number)
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut inner = self.order.lock();
        inner.out.remove(&self.number);
        // An unprepare recorded before the oldest ticket still out can overtake nobody any more.
        match inner.out.first().copied() {
            None => inner.unprepared.clear(),
            Some(oldest) => inner.unprepared.retain(|_, at| *at >= oldest),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prepare_asked_before_its_claim_was_unprepared_is_overtaken() {
        let order = CallOrder::default();
        let late = order.arrive();
        order.unprepared("a");
        assert!(late.overtaken("a"), "asked before the unprepare");
        assert!(!late.overtaken("b"), "another claim");
        let again = order.arrive();
        assert!(!again.overtaken("a"), "asked after the unprepare: the kubelet wants the claim again");
    }

    #[test]
    fn an_unprepare_with_no_prepare_in_flight_records_nothing() {
        let order = CallOrder::default();
        order.unprepared("a");
        assert_eq!(order.recorded(), 0);
        assert!(!order.arrive().overtaken("a"));
    }

    #[test]
    fn records_last_only_while_a_ticket_they_could_overtake_is_out() {
        let order = CallOrder::default();
        let first = order.arrive();
        order.unprepared("a");
        let second = order.arrive();
        order.unprepared("b");
        assert!(first.overtaken("a") && first.overtaken("b"));
        assert!(!second.overtaken("a") && second.overtaken("b"));
        drop(first);
        assert_eq!(order.recorded(), 1, "a overtook only the first ticket, which is done");
        assert!(second.overtaken("b"), "b still overtakes the second");
        drop(second);
        assert_eq!(order.recorded(), 0, "nothing out, nothing kept");
    }

    #[test]
    fn a_later_unprepare_of_the_same_claim_moves_its_mark_on() {
        let order = CallOrder::default();
        let first = order.arrive();
        order.unprepared("a");
        let second = order.arrive();
        assert!(!second.overtaken("a"));
        order.unprepared("a");
        assert!(second.overtaken("a") && first.overtaken("a"));
    }
}
